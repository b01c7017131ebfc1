"""Template: renders a Trajectory with the tokenizer's chat template and labels its assistant turns.

Labels follow Twinkle: after encoding, labels are shifted left by one (labels[i] is the token
position i predicts) and are -100 everywhere except on assistant turns. An assistant turn is
trained from its first content token through the end-of-turn token that closes it (e.g.
<|im_end|>); the role header before it and whitespace after it are not.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from twinkle.data_format import InputFeature, Message, Trajectory
from twinkle.template._masking import assistant_char_spans, label_tokens
from twinkle.template._source import tokenizer_dir

TruncationStrategy = Literal["raise", "left", "right", "split", "delete"]
IGNORE_INDEX = -100

# Keyword arguments of Template that are not tokenizer loading options.
_CHAT_TEMPLATE_KWARGS = ("enable_thinking",)


class Template:
    """Encodes trajectories for one model's tokenizer.

    Args:
        model_id: a local directory with tokenizer files, or the server's model id (ms://...,
            hf://..., org/name), whose tokenizer is fetched from twinkle-server.
        use_chat_template: False encodes a single user message's text as it is (all trained).
        max_length: longest encoded sequence; longer ones follow truncation_strategy.
        truncation_strategy: raise (ValueError), left / right (cut that side), split (several
            rows), delete (drop the row).
        default_system: a system message put first when a trajectory starts with a user turn.
        enable_thinking: passed to the chat template (Qwen3 templates read it).
        Other keyword arguments go to transformers.AutoTokenizer.from_pretrained.
    """

    # Text of the token that ends an assistant turn when the chat template does not say.
    end_of_turn: str | None = None

    def __init__(
        self,
        model_id: str | os.PathLike[str],
        use_chat_template: bool = True,
        max_length: int | None = 8192,
        truncation_strategy: TruncationStrategy = "raise",
        default_system: str | None = None,
        **kwargs: Any,
    ) -> None:
        if truncation_strategy not in ("raise", "left", "right", "split", "delete"):
            raise ValueError(f"truncation_strategy: unknown '{truncation_strategy}'")
        if max_length is not None and max_length <= 0:
            raise ValueError(f"max_length must be positive, got {max_length}")
        self.model_id = os.fspath(model_id)
        self.use_chat_template = use_chat_template
        self.max_length = max_length
        self.truncation_strategy: TruncationStrategy = truncation_strategy
        self.default_system = default_system
        self.chat_template_kwargs: dict[str, Any] = {
            k: kwargs.pop(k) for k in _CHAT_TEMPLATE_KWARGS if k in kwargs
        }
        self.processor = self._load_tokenizer(tokenizer_dir(model_id), kwargs)
        self._check_tokenizer()

    # ---- loading ---------------------------------------------------------------------------

    @staticmethod
    def _load_tokenizer(directory: os.PathLike[str], options: Mapping[str, Any]) -> Any:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:
            raise ImportError(
                "twinkle templates need transformers: pip install 'twinkle-server-client[template]'"
            ) from exc
        return AutoTokenizer.from_pretrained(os.fspath(directory), **options)

    def _check_tokenizer(self) -> None:
        """Subclasses check the tokenizer fits them (special tokens, chat template)."""
        if self.use_chat_template and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(
                f"the tokenizer of {self.model_id} has no chat template; use a model-specific "
                "template (e.g. Qwen3_5Template) or use_chat_template=False"
            )
        if not getattr(self.tokenizer, "is_fast", False):
            raise ValueError(f"the tokenizer of {self.model_id} is not a fast tokenizer (offsets are needed)")

    @property
    def tokenizer(self) -> Any:
        return getattr(self.processor, "tokenizer", self.processor)

    # ---- encoding ------------------------------------------------------------------------

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The chat template's text for messages."""
        options = dict(self.chat_template_kwargs)
        if tools:
            options["tools"] = [dict(t) for t in tools]
        return str(self.tokenizer.apply_chat_template(
            [dict(m) for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt, **options))

    def encode(self, trajectory: Trajectory | Mapping[str, Any], add_generation_prompt: bool = False) -> InputFeature:
        """One trajectory -> input_ids and (unshifted) labels; batch_encode adds the rest."""
        messages = self._messages(trajectory)
        if not self.use_chat_template:
            if len(messages) != 1 or messages[0].get("role") != "user":
                raise ValueError("use_chat_template=False encodes exactly one user message")
            ids = self._tokenize(str(messages[0].get("content", "")))[0]
            return InputFeature(input_ids=np.asarray(ids, dtype=np.int64), labels=np.asarray(ids, dtype=np.int64))
        tools = trajectory.get("tools") or None
        if add_generation_prompt:
            ids = self._tokenize(self.render(messages, True, tools))[0]
            labels = [IGNORE_INDEX] * len(ids)
        else:
            text = self.render(messages, False, tools)
            render: Callable[[Sequence[Mapping[str, Any]], bool], str] = (
                lambda msgs, gen: self.render(msgs, gen, tools))
            spans = assistant_char_spans(messages, text, render, self.end_of_turn)
            ids, offsets = self._tokenize(text)
            labels = label_tokens(ids, offsets, spans)
        return InputFeature(input_ids=np.asarray(ids, dtype=np.int64), labels=np.asarray(labels, dtype=np.int64))

    def batch_encode(
        self,
        trajectories: Sequence[Trajectory | Mapping[str, Any]] | Mapping[str, Sequence[Any]],
        add_generation_prompt: bool = False,
    ) -> Any:
        """Encode trajectories: a list of them, or columns ({'messages': [...], ...}).

        Returns InputFeatures (input_ids, labels shifted, attention_mask, position_ids, length);
        given columns, returns columns. A row may become several (truncation 'split') or none
        ('delete').
        """
        as_columns = isinstance(trajectories, Mapping)
        rows = _columns_to_rows(trajectories) if as_columns else list(trajectories)  # type: ignore[arg-type]
        output: list[InputFeature] = []
        for row in rows:
            output.extend(self._post_process(self.encode(row, add_generation_prompt)))
        if as_columns:
            return _rows_to_columns(output)
        return output

    def check(self, trajectory: Trajectory | Mapping[str, Any]) -> Trajectory | Mapping[str, Any] | None:
        """The trajectory if it encodes (within max_length), else None."""
        try:
            return trajectory if self.batch_encode([trajectory]) else None
        except ValueError:
            return None

    def batch_check(self, trajectories: Sequence[Trajectory]) -> list[Any]:
        return [self.check(t) for t in trajectories]

    def decode(self, token_ids: Any, **kwargs: Any) -> str:
        ids = token_ids.tolist() if hasattr(token_ids, "tolist") else list(token_ids)
        return str(self.tokenizer.decode(ids, **kwargs))

    def batch_decode(self, token_ids: Sequence[Any], **kwargs: Any) -> list[str]:
        return [self.decode(ids, **kwargs) for ids in token_ids]

    def concat_input_feature(self, prompt_input_feature: Mapping[str, Any], new_tokens: Sequence[int]) -> InputFeature:
        """Prompt + sampled completion as a training row: labels on the completion only.

        The prompt feature's other keys are kept; when it carries messages, the decoded
        completion is appended as the assistant turn (rewards read it there).
        """
        if self.truncation_strategy == "split":
            raise ValueError("concat_input_feature does not support truncation_strategy='split'")
        result: dict[str, Any] = copy.deepcopy(dict(prompt_input_feature))
        prompt = [int(t) for t in np.asarray(result["input_ids"]).reshape(-1).tolist()]
        completion = [int(t) for t in new_tokens]
        base = InputFeature(
            input_ids=np.asarray(prompt + completion, dtype=np.int64),
            labels=np.asarray([IGNORE_INDEX] * len(prompt) + completion, dtype=np.int64),
        )
        processed = self._post_process(base)
        if not processed:
            raise ValueError(f"prompt + completion ({len(prompt) + len(completion)} tokens) exceeds max_length")
        result.update(processed[0])
        if isinstance(result.get("messages"), list):
            text = self.decode(completion, skip_special_tokens=True)
            result["messages"] = [*result["messages"], Message(role="assistant", content=text)]
        return InputFeature(**result)  # type: ignore[typeddict-item]

    # ---- pieces ----------------------------------------------------------------------------

    def _messages(self, trajectory: Trajectory | Mapping[str, Any]) -> list[dict[str, Any]]:
        raw = trajectory.get("messages")
        if not raw:
            raise ValueError("a trajectory needs a non-empty 'messages' list")
        messages = []
        for m in raw:
            message = dict(m)
            if message.get("content") is None:
                message["content"] = ""
            messages.append(message)
        if self.use_chat_template and self.default_system and messages[0].get("role") == "user":
            messages.insert(0, {"role": "system", "content": self.default_system})
        return messages

    def _tokenize(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]

    def _post_process(self, feature: InputFeature) -> list[InputFeature]:
        """Length check / truncation, then attention_mask, position_ids, length, shifted labels."""
        out = []
        for piece in self._truncate(feature):
            ids = np.asarray(piece["input_ids"], dtype=np.int64)
            labels = np.asarray(piece["labels"], dtype=np.int64)
            piece["input_ids"] = ids
            piece["attention_mask"] = np.ones_like(ids)
            piece["position_ids"] = np.arange(len(ids), dtype=np.int64)
            piece["length"] = int(len(ids))
            piece["labels"] = np.roll(labels, -1)
            if len(labels):
                piece["labels"][-1] = IGNORE_INDEX
            out.append(piece)
        return out

    def _truncate(self, feature: InputFeature) -> list[InputFeature]:
        n = len(feature["input_ids"])
        limit = self.max_length
        if limit is None or n <= limit:
            return [feature]
        strategy = self.truncation_strategy
        if strategy == "raise":
            raise ValueError(f"an encoded trajectory of {n} tokens exceeds max_length {limit}")
        if strategy == "delete":
            return []
        if strategy == "left":
            return [InputFeature(**{k: v[-limit:] for k, v in feature.items()})]  # type: ignore[typeddict-item]
        if strategy == "right":
            return [InputFeature(**{k: v[:limit] for k, v in feature.items()})]  # type: ignore[typeddict-item]
        return [
            InputFeature(**{k: v[s:s + limit] for k, v in feature.items()})  # type: ignore[typeddict-item]
            for s in range(0, n, limit)
        ]


def _columns_to_rows(columns: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    if not columns:
        return []
    count = len(next(iter(columns.values())))
    return [{k: v[i] for k, v in columns.items()} for i in range(count)]


def _rows_to_columns(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Any]]:
    if not rows:
        return {}
    return {k: [r[k] for r in rows] for k in rows[0]}
