"""Sampling parameters and results, with Twinkle's field names."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class SamplingParams:
    """Twinkle's SamplingParams. max_new_tokens is accepted as an alias of max_tokens.

    stop: a string, a list of strings, or a list of token ids. Log-probs are the model's
    log-softmax of its raw logits. The sampled token's log-prob at each position comes back
    always (logprobs None, 0 or 1); logprobs = k > 1 returns the k most likely tokens at each
    position instead. prompt_logprobs: True returns the prompt tokens' log-probs; an int k >= 1
    returns those and the k most likely tokens at each prompt position (k <= 20).
    """

    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    num_samples: int = 1

    @classmethod
    def from_any(cls, params: SamplingParams | Mapping[str, Any] | None) -> SamplingParams:
        """A SamplingParams from itself, a dict of its fields (plus max_new_tokens), or None."""
        if params is None:
            return cls()
        if isinstance(params, SamplingParams):
            return params
        if not isinstance(params, Mapping):
            raise TypeError(f"sampling_params must be a SamplingParams or a dict, got {type(params).__name__}")
        values = dict(params)
        if "max_new_tokens" in values:
            alias = values.pop("max_new_tokens")
            values.setdefault("max_tokens", alias)
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"sampling_params: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _DictLike:
    """Attribute access plus .get / [] with the field names, as Twinkle's results allow both."""

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError as exc:
            raise KeyError(key) from exc

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and hasattr(self, key)


@dataclass
class SampledSequence(_DictLike):
    """One completion. logprobs: one entry per generated token, [(token_id, logprob)] (Twinkle's
    top-k shape with k = 1: the sampled token) or, with sampling_params.logprobs = k > 1, the k
    most likely tokens by descending log-prob (the sampled one is not necessarily among them).
    new_input_feature: prompt + completion encoded for training (labels on the completion only)."""

    stop_reason: str
    tokens: list[int]
    logprobs: list[list[tuple[int, float]]] | None = None
    decoded: str | None = None
    new_input_feature: dict[str, Any] | None = None


@dataclass
class SampleResponse(_DictLike):
    """The completions of one prompt."""

    sequences: list[SampledSequence] = field(default_factory=list)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None
    # With prompt_logprobs = k: per prompt position the k most likely tokens [(token_id, logprob)],
    # by descending log-prob; None at position 0, which nothing predicts.
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
