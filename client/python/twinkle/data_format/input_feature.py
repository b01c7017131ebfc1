"""Encoded sequences (what a template produces and the model trains on) and model outputs."""

from __future__ import annotations

from typing import Any

from typing_extensions import TypedDict


class InputFeature(TypedDict, total=False):
    """One encoded sequence, as Twinkle's templates produce it.

    input_ids: token ids (a numpy int64 array from a template; lists are accepted everywhere).
    labels: as long as input_ids and already shifted, as in Twinkle: labels[i] is the token that
        position i predicts (input_ids[i + 1]) or -100 where nothing is trained; the last
        position predicts nothing.
    attention_mask, position_ids, length: filled in by templates; position_ids restart at 0 at
        each sequence packed into one row.
    Any other keys of the source row (messages, user_data, ...) travel along untouched.
    """

    input_ids: Any
    labels: Any
    attention_mask: Any
    position_ids: Any
    length: int
    messages: list[Any]
    user_data: Any


class ModelOutput(TypedDict, total=False):
    """What forward / forward_only / forward_backward return.

    loss: the batch loss (0.0 without a loss, e.g. forward_only).
    logps: per input row, a float32 numpy array aligned with the shifted labels: logps[i] is
        log p(input_ids[i + 1] | input_ids[:i + 1]); 0.0 at the last position.
    metrics: the server's numbers for the call (token counts, ...).
    """

    loss: float
    logps: list[Any]
    metrics: dict[str, float]
