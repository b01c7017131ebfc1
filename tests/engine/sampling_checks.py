"""Checks shared by the sampler tests of every family."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from engine_harness import Engine
from numerics import assert_close


def assert_samples_match_training_forward(engine: Engine, results: Mapping[int, Any] | Sequence[Any],
                                          adapters: Sequence[str], prompts: Sequence[torch.Tensor],
                                          max_tokens: int, tol: float = 1e-5) -> float:
    """Every sample of row i (results[i], for adapter adapters[i] on prompts[i]) ran to
    `max_tokens`, and its token log-probs and the row's prompt log-probs equal what the
    training forward gives for the same sequence (absolute `tol`). Returns the largest
    difference."""
    worst = 0.0
    for i, (a, p) in enumerate(zip(adapters, prompts)):
        result = results[i]
        for s, got in enumerate(result["samples"]):
            assert got["stop_reason"] == "length" and len(got["tokens"]) == max_tokens
            seq = torch.cat([p, got["tokens"]])
            datum = {"input_tokens": seq[:-1], "target_tokens": seq[1:]}
            fwd = engine.call("forward", {"ops": [{"adapter_id": a, "datums": [datum]}]})["ops"][0]["logprobs"][0]
            worst = max(worst, assert_close(f"row{i} sample{s} token logprobs", got["logprobs"],
                                            fwd[len(p) - 1:], tol, absolute=True))
            worst = max(worst, assert_close(f"row{i} prompt logprobs", result["prompt_logprobs"],
                                            fwd[:len(p) - 1], tol, absolute=True))
    return worst
