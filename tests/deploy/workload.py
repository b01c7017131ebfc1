"""A short real workload through the tinker SDK: one LoRA training client, forward_backward
and an optimizer step, so that every step, token and queue metric has data."""

from __future__ import annotations

import math
import os
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "1")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

MODEL_NAME = "tiny-qwen3"
SEQ = [11, 42, 7, 99, 123, 5, 64, 300, 17, 250]


def datum(seq: list[int]) -> types.Datum:
    n = len(seq) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(seq[:-1]),
        loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * n},
    )


def _resolved(made: Any) -> Any:
    """create_lora_training_client returns a future-like proxy in tinker 0.38."""
    return made.result() if hasattr(made, "result") else made


def forward_backward(base_url: str, api_key: str, steps: int = 2) -> list[float]:
    """`steps` rounds of forward_backward + optim_step; returns each round's loss."""
    service = tinker.ServiceClient(base_url=base_url, api_key=api_key)
    training = _resolved(service.create_lora_training_client(base_model=MODEL_NAME, rank=4))
    losses = []
    for _ in range(steps):
        out = training.forward_backward([datum(SEQ)], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        loss = float(out.metrics["loss:sum"])
        assert math.isfinite(loss), out.metrics
        losses.append(loss)
    return losses
