"""vLLMSampler: Twinkle's sampler client, sampling on twinkle-server's engine.

sample() takes Trajectories (encoded here with the generation prompt) or prompt InputFeatures,
and samples from the base model or from a checkpoint (adapter_uri = the twinkle:// path
model.save returned). Each completion comes back with its exact per-token log-probs (in
Twinkle's [[(token_id, logprob)], ...] shape), its decoded text, and new_input_feature: prompt +
completion ready for model.forward_backward, carrying the prompt row's messages (with the
completion appended as the assistant turn) and user_data for rewards.

sampling_params.logprobs = k > 1 returns the k most likely tokens at each generated position
instead of the sampled one (Twinkle's top-k shape); prompt_logprobs = k (an int >= 1) adds
topk_prompt_logprobs, the k most likely tokens at each prompt position. Every log-prob is the
model's log-softmax of its raw logits, whatever temperature / top_k / top_p shaped the draw.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Mapping
from typing import Any

import twinkle.template as template_module
from twinkle import get_logger
from twinkle.data_format import SampledSequence, SampleResponse, SamplingParams
from twinkle.template import Template
from twinkle.utils import construct_class, to_int_list
from twinkle_client import _context
from twinkle_client._proto.twinkle.v1 import sampler_pb2 as spb
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb
from twinkle_client._rpc import ProgressCallback
from twinkle_client.errors import UnsupportedFeatureError
from twinkle_client.manager import TwinkleClient
from twinkle_client.model._inputs import as_rows

logger = get_logger("twinkle_client")

MAX_TOP_LOGPROBS = 20  # the server's cap on a top-k width


def _top_width(value: Any, name: str) -> int:
    """A top-k width from sampling_params: None/False -> 0, True -> 1, else an int in [0, 20]."""
    if value is None or value is False:
        return 0
    if value is True:
        return 1
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"sampling_params.{name}: {value!r} must be an int in [0, {MAX_TOP_LOGPROBS}]")
    return value


def _pairs(top: Any) -> list[tuple[int, float]]:
    return [(int(t), float(lp)) for t, lp in zip(top.token_ids, top.logprobs)]


class SampleResponses(list):  # type: ignore[type-arg]
    """One SampleResponse per prompt (iterate it, as Twinkle's local sampler returns), which also
    answers ['sequences'] / .get('sequences') / .sequences with every completion, prompt by
    prompt (as Twinkle's client sampler returns)."""

    @property
    def sequences(self) -> list[SampledSequence]:
        return [s for response in self for s in response.sequences]

    def get(self, key: str, default: Any = None) -> Any:
        if key == "sequences":
            return self.sequences
        if key == "samples":
            return list(self)
        return default

    def __getitem__(self, key: Any) -> Any:  # type: ignore[override]
        if isinstance(key, str):
            if key not in ("sequences", "samples"):
                raise KeyError(key)
            return self.get(key)
        return super().__getitem__(key)


class vLLMSampler:  # noqa: N801 - Twinkle's name
    """Args:
        model_id: the base model (ms://..., or a local tokenizer directory for the template).
        client: default: the one init_twinkle_client made. engine_args, device_mesh,
            remote_group: accepted for Twinkle compatibility (the server owns its engine).
    """

    def __init__(self, model_id: str, *, client: TwinkleClient | None = None,
                 progress: bool | ProgressCallback | None = None, **kwargs: Any) -> None:
        self.model_id = model_id
        self.client = client or _context.current()
        self.progress = progress
        self._template: Template | None = None
        self._template_spec: tuple[Any, dict[str, Any]] | None = None
        self._session: tuple[str, str] | None = None  # (model_path, sampling_session_id)

    def _call(self, rpc: str, request: Any) -> Any:
        return self.client.call(getattr(self.client.sampler, rpc), request, name=rpc, progress=self.progress)

    # ---- configuration -------------------------------------------------------------------

    def set_template(self, template_cls: Any = "Template", adapter_name: str = "", **kwargs: Any) -> None:
        """The template for encoding prompts and decoding completions (model_id defaults to the sampler's)."""
        self._template_spec = (template_cls, kwargs)
        self._template = None

    def template(self) -> Template:
        if self._template is None:
            spec, kwargs = self._template_spec or (Template, {})
            self._template = construct_class(spec, Template, template_module, **{"model_id": self.model_id, **kwargs})
        return self._template

    def add_adapter_to_sampler(self, adapter_name: str, config: Any, **kwargs: Any) -> None:
        raise UnsupportedFeatureError("add_adapter_to_sampler: sample from a saved checkpoint instead "
                                      "(adapter_uri=model.save(name, is_sampler=True))")

    def sync_weights(self, *args: Any, **kwargs: Any) -> None:
        raise UnsupportedFeatureError("sync_weights: sample from a saved checkpoint instead (adapter_uri=...)")

    def reset_prefix_cache(self) -> None:
        """Nothing to do: the server keeps its caches per tenant."""

    # ---- sessions ------------------------------------------------------------------------

    def _session_for(self, model_path: str) -> str:
        if self._session is not None and self._session[0] == model_path:
            return self._session[1]
        reply = self._call("CreateSamplingSession", spb.CreateSamplingSessionRequest(model_path=model_path))
        self.close()
        self._session = (model_path, reply.sampling_session_id)
        return reply.sampling_session_id

    def close(self) -> None:
        """Close the current sampling session (a new one opens on the next sample)."""
        if self._session is None:
            return
        _, session_id = self._session
        self._session = None
        try:
            self._call("CloseSamplingSession", spb.SamplingSessionRequest(sampling_session_id=session_id))
        except Exception as exc:  # noqa: BLE001 - best effort; the server expires sessions too
            logger.warning(f"closing sampling session {session_id}: {exc}")

    # ---- sampling ------------------------------------------------------------------------

    def sample(self, inputs: Any, sampling_params: SamplingParams | Mapping[str, Any] | None = None,
               adapter_name: str = "", adapter_uri: str | None = None, num_samples: int = 1,
               **kwargs: Any) -> SampleResponses:
        """Completions for each input: num_samples each (the argument, or sampling_params'
        num_samples when the argument is left at 1)."""
        if adapter_name:
            raise UnsupportedFeatureError("sample(adapter_name=...): pass adapter_uri (a saved checkpoint's twinkle:// path)")
        params = SamplingParams.from_any(sampling_params)
        count = int(num_samples) if num_samples != 1 else int(params.num_samples or 1)
        wire_params = self._params(params, count)  # bad parameters fail before any call
        rows = self._prompt_rows(as_rows(inputs))
        request = spb.SampleRequest(
            sampling_session_id=self._session_for(str(adapter_uri or "")),
            prompts=[spb.Prompt(tokens=to_int_list(r["input_ids"])) for r in rows],
            params=wire_params,
            options=tpb.RequestOptions(idempotency_key=uuid.uuid4().hex))
        reply = self._call("Sample", request)
        if len(reply.results) != len(rows):
            raise RuntimeError(f"the server returned {len(reply.results)} results for {len(rows)} prompts")
        return SampleResponses(self._response(row, result, params) for row, result in zip(rows, reply.results))

    def _prompt_rows(self, rows: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
        out = []
        for row in rows:
            if "input_ids" in row:
                out.append(row)
            elif "messages" in row:
                features = self.template().batch_encode([row], add_generation_prompt=True)
                if len(features) != 1:
                    raise ValueError("a prompt encoded to several sequences (max_length / truncation 'split')")
                out.append({**row, **features[0]})
            else:
                raise ValueError("each input needs messages (a Trajectory) or input_ids (a prompt InputFeature)")
        return out

    @staticmethod
    def _params(params: SamplingParams, count: int) -> spb.SamplingParams:
        k = _top_width(params.logprobs, "logprobs")
        prompt_k = _top_width(params.prompt_logprobs, "prompt_logprobs")
        # logprobs = 1 is the sampled token's own (always returned); only k > 1 asks for top-k.
        # prompt_logprobs = True asks for the prompt tokens' own only, an int k also for top-k.
        out = spb.SamplingParams(max_tokens=int(params.max_tokens or 0), top_p=float(params.top_p or 0.0),
                                 top_k=max(0, int(params.top_k or 0)), num_samples=count,
                                 prompt_logprobs=prompt_k > 0, top_logprobs=k if k > 1 else 0,
                                 prompt_top_logprobs=0 if params.prompt_logprobs is True else prompt_k)
        out.temperature = float(params.temperature)
        penalty = float(1.0 if params.repetition_penalty is None else params.repetition_penalty)
        if not penalty > 0 or math.isinf(penalty):
            raise ValueError(f"sampling_params.repetition_penalty: {params.repetition_penalty!r} must be > 0 (1 = off)")
        out.repetition_penalty = penalty
        if params.seed is not None:
            out.seed = int(params.seed)
        stop = params.stop
        if isinstance(stop, str):
            out.stop.append(stop)
        elif stop:
            for item in stop:
                if isinstance(item, str):
                    out.stop.append(item)
                else:
                    out.stop_token_ids.append(int(item))
        return out

    def _response(self, row: Mapping[str, Any], result: Any, params: SamplingParams) -> SampleResponse:
        template = self.template()
        sequences = []
        for seq in result.sequences:
            tokens = list(seq.tokens)
            if len(seq.top_logprobs):  # top-k asked for: Twinkle's shape, sorted by logprob
                logprobs = [_pairs(top) for top in seq.top_logprobs]
            else:
                logprobs = [[(t, float(lp))] for t, lp in zip(tokens, seq.logprobs)]
            sequences.append(SampledSequence(
                stop_reason=seq.stop_reason or "length",
                tokens=tokens,
                logprobs=logprobs,
                decoded=template.decode(tokens, skip_special_tokens=True),
                new_input_feature=dict(template.concat_input_feature(row, tokens))))
        prompt_logprobs = None
        if params.prompt_logprobs:
            prompt_logprobs = [None if math.isnan(v) else float(v) for v in result.prompt_logprobs]
        topk_prompt_logprobs = None
        if len(result.prompt_top_logprobs):  # position 0 predicts nothing: None, as Twinkle has it
            topk_prompt_logprobs = [_pairs(top) if i > 0 else None for i, top in enumerate(result.prompt_top_logprobs)]
        return SampleResponse(sequences=sequences, prompt_token_ids=to_int_list(row["input_ids"]),
                              prompt_logprobs=prompt_logprobs, topk_prompt_logprobs=topk_prompt_logprobs)
