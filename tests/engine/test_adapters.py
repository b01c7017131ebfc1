"""Adapter lifecycle through the engine's IPC: state transfer, limits, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load
from engine_harness import Engine, EngineError
from numerics import assert_close
from test_fused import HYPER, data

FAILED_PRECONDITION, NOT_FOUND, ALREADY_EXISTS, INVALID_ARGUMENT = 9, 5, 6, 3


def train(engine: Engine, adapter: str, rounds: range) -> None:
    for r in rounds:
        engine.call("forward_backward", {"ops": [{"adapter_id": adapter, "datums": data("a", r),
                                                  "loss": {"name": "cross_entropy"}}]})
        engine.call("optim_step", {"adapter_id": adapter, "hyper": HYPER})


def test_state_transfer_resumes_training_exactly(reference_models: Path) -> None:
    """Weights + optimizer state moved to a fresh adapter in another worker (what a checkpoint
    or an offload does) continue training exactly as if never moved."""
    model_dir = reference_models / "qwen3"
    spec = {"adapter_id": "x", "rank": 4, "alpha": 8.0, "seed": 1}
    with Engine() as first, Engine() as second:
        load(first, model_dir)
        load(second, model_dir)
        first.call("create_adapter", spec)
        train(first, "x", range(3))
        state = first.call("get_adapter_state", {"adapter_id": "x"})
        second.call("create_adapter", {**spec, "seed": 99})  # different init: must be overwritten
        second.call("set_adapter_state", {"adapter_id": "x", "weights": state["weights"],
                                          "optimizer": state["optimizer"]})
        train(first, "x", range(3, 6))
        train(second, "x", range(3, 6))
        a = first.call("get_adapter_state", {"adapter_id": "x"})
        b = second.call("get_adapter_state", {"adapter_id": "x"})
    assert a["step"] == b["step"] == 6
    for name in a["weights"]:
        assert_close(f"resumed {name}", b["weights"][name], a["weights"][name], 1e-6, absolute=True)


def test_rank_limit_and_errors(reference_models: Path) -> None:
    with Engine() as engine:
        engine.call("load_model", {"model_dir": str(reference_models / "qwen3"), "dtype": "float32",
                                   "device": "cpu", "max_lora_rank": 8})
        with pytest.raises(EngineError) as e:
            engine.call("create_adapter", {"adapter_id": "big", "rank": 16})
        assert e.value.code == FAILED_PRECONDITION and "max_lora_rank of 8" in e.value.message
        engine.call("create_adapter", {"adapter_id": "ok", "rank": 8})
        with pytest.raises(EngineError) as e:
            engine.call("create_adapter", {"adapter_id": "ok", "rank": 8})
        assert e.value.code == ALREADY_EXISTS
        with pytest.raises(EngineError) as e:
            engine.call("create_adapter", {"adapter_id": "t", "targets": ["qkv"]})
        assert e.value.code == INVALID_ARGUMENT and "'qkv'" in e.value.message
        with pytest.raises(EngineError) as e:
            engine.call("forward", {"ops": [{"adapter_id": "ok", "datums": [
                {"input_tokens": torch.tensor([1, 2, 999]), "target_tokens": torch.tensor([1, 2, 3])}]}]})
        assert e.value.code == INVALID_ARGUMENT and "outside [0, 256)" in e.value.message
        with pytest.raises(EngineError) as e:
            engine.call("optim_step", {"adapter_id": "nope"})
        assert e.value.code == NOT_FOUND
        with pytest.raises(EngineError) as e:
            engine.call("set_adapter_state", {"adapter_id": "ok", "weights": {
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(3, 3)}})
        assert e.value.code == INVALID_ARGUMENT and "shape" in e.value.message
        engine.call("remove_adapter", {"adapter_id": "ok"})
        with pytest.raises(EngineError) as e:
            engine.call("get_adapter_state", {"adapter_id": "ok"})
        assert e.value.code == NOT_FOUND


def test_training_methods_need_a_model() -> None:
    with Engine() as engine:
        with pytest.raises(EngineError) as e:
            engine.call("create_adapter", {"adapter_id": "x"})
        assert e.value.code == FAILED_PRECONDITION and "load_model first" in e.value.message
