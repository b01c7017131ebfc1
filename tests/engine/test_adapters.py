"""Adapter lifecycle through the engine's IPC: state transfer, limits, errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def test_reset_optimizer_trains_on_like_a_fresh_adapter(reference_models: Path) -> None:
    """set_adapter_state with reset_optimizer (Tinker's load_state, weights only): the next
    steps equal those of a new adapter given the same weights, whose optimizer is fresh."""
    spec = {"adapter_id": "x", "rank": 4, "alpha": 8.0, "seed": 1}
    with Engine() as engine:
        load(engine, reference_models / "qwen3")
        engine.call("create_adapter", spec)
        engine.call("create_adapter", {**spec, "adapter_id": "fresh", "seed": 7})
        train(engine, "x", range(3))
        state = engine.call("get_adapter_state", {"adapter_id": "x"})
        assert state["step"] == 3 and any(t.abs().max() > 0 for t in state["optimizer"].values())
        engine.call("set_adapter_state", {"adapter_id": "x", "weights": state["weights"], "grads": {},
                                          "reset_optimizer": True})
        engine.call("set_adapter_state", {"adapter_id": "fresh", "weights": state["weights"]})
        reset = engine.call("get_adapter_state", {"adapter_id": "x"})
        assert reset["step"] == 0 and reset["optimizer_kind"] == "adamw"
        train(engine, "x", range(3, 5))
        train(engine, "fresh", range(3, 5))
        x = engine.call("get_adapter_state", {"adapter_id": "x"})
        fresh = engine.call("get_adapter_state", {"adapter_id": "fresh"})
    assert x["step"] == fresh["step"] == 2
    diff = max_abs_diff(x["weights"], fresh["weights"])
    print(f"reset optimizer vs fresh adapter after 2 steps: max|weight diff| = {diff:.3e}")
    assert diff == 0.0 and max_abs_diff(x["optimizer"], fresh["optimizer"]) == 0.0


OFFLOAD_SPEC = {"adapter_id": "x", "rank": 4, "alpha": 8.0, "seed": 1, "dropout": 0.1,
                "targets": ["all-linear", "lm_head"]}


def backward(engine: Engine, adapter: str, round_: int) -> None:
    engine.call("forward_backward", {"ops": [{"adapter_id": adapter, "datums": data("a", round_),
                                              "loss": {"name": "cross_entropy"}}]})


def restore_body(state: dict[str, Any], omit: str = "") -> dict[str, Any]:
    """set_adapter_state's body from get_adapter_state's reply (what the coordinator sends)."""
    fields = ("weights", "grads", "optimizer", "optimizer_kind", "micro_batches_since_step")
    return {"adapter_id": "x", **{f: state[f] for f in fields if f != omit}}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].numel()), default=0.0)


def offload_run(model_dir: Path, offload: bool, omit: str = "") -> dict[str, Any]:
    """Six optimizer steps with dropout on; with `offload`, the adapter is offloaded and
    reloaded in the middle of step 4's accumulation window (one micro-batch in, one to go)."""
    with Engine() as engine:
        load(engine, model_dir)
        engine.call("create_adapter", OFFLOAD_SPEC)
        engine.call("set_optimizer", {"adapter_id": "x", "optimizer": "Adam"})  # not the spec's kind
        train(engine, "x", range(3))
        backward(engine, "x", 3)
        if offload:
            state = engine.call("get_adapter_state", {"adapter_id": "x"})
            assert state["micro_batches_since_step"] == 1 and state["grads"] and state["step"] == 3
            assert state["optimizer_kind"] == "adam"
            assert state["config"] == {**OFFLOAD_SPEC, "optimizer": "adam", "use_rslora": False,
                                       "targets": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                   "up_proj", "down_proj", "lm_head"]}
            engine.call("remove_adapter", {"adapter_id": "x"})
            engine.call("create_adapter", OFFLOAD_SPEC)  # the coordinator's own spec: adamw
            engine.call("set_adapter_state", restore_body(state, omit))
            if not omit:
                again = engine.call("get_adapter_state", {"adapter_id": "x"})
                for part in ("weights", "grads", "optimizer"):
                    assert max_abs_diff(again[part], state[part]) == 0.0, part
                assert again["micro_batches_since_step"] == 1 and again["optimizer_kind"] == "adam"
        backward(engine, "x", 4)  # dropout masks keyed by (step 3, micro-batch 1)
        engine.call("optim_step", {"adapter_id": "x", "hyper": HYPER})
        train(engine, "x", range(5, 7))
        return engine.call("get_adapter_state", {"adapter_id": "x"})


def test_offload_round_trip_is_bit_identical(reference_models: Path) -> None:
    """get_adapter_state + remove_adapter, then create_adapter + set_adapter_state, halfway
    through an accumulation window with dropout: training continues bit for bit."""
    model_dir = reference_models / "qwen3"
    never = offload_run(model_dir, offload=False)
    offloaded = offload_run(model_dir, offload=True)
    assert never["step"] == offloaded["step"] == 6
    weights = max_abs_diff(offloaded["weights"], never["weights"])
    optimizer = max_abs_diff(offloaded["optimizer"], never["optimizer"])
    print(f"offloaded vs never offloaded: max|weight diff| = {weights:.3e}, "
          f"max|optimizer state diff| = {optimizer:.3e}")
    assert weights == 0.0 and optimizer == 0.0
    # Guard: the counter matters (without it step 4's second micro-batch redraws the first's
    # dropout masks), so the equality above is not vacuous.
    forgot = offload_run(model_dir, offload=True, omit="micro_batches_since_step")
    print(f"without micro_batches_since_step: max|weight diff| = "
          f"{max_abs_diff(forgot['weights'], never['weights']):.3e}")
    assert max_abs_diff(forgot["weights"], never["weights"]) > 0


def test_set_adapter_state_changes_nothing_on_error(reference_models: Path) -> None:
    q_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    with Engine() as engine:
        load(engine, reference_models / "qwen3")
        engine.call("create_adapter", OFFLOAD_SPEC)
        train(engine, "x", range(1))
        backward(engine, "x", 1)
        before = engine.call("get_adapter_state", {"adapter_id": "x"})
        new_weights = {k: v + 1 for k, v in before["weights"].items()}  # valid, so only the bad part fails
        no_momentum = {k: v for k, v in before["optimizer"].items() if not k.startswith("exp_avg.")}
        bad: list[tuple[dict[str, Any], str]] = [
            ({"grads": {q_a: torch.zeros(2, 2)}}, "shape"),
            ({"grads": {"lm_head.lora_A.weight": torch.zeros(4, 64)}}, "no gradient 'lm_head.lora_A.weight'"),
            ({"micro_batches_since_step": -1}, "micro_batches_since_step must be >= 0"),
            ({"optimizer_kind": "lion"}, "unknown optimizer 'lion'"),
            ({"optimizer": no_momentum}, "optimizer state 'exp_avg.0' is missing"),
            ({"optimizer_kind": "sgd", "optimizer": before["optimizer"]}, "unknown optimizer state"),
            ({"reset_optimizer": True, "optimizer": before["optimizer"]}, "exclusive"),
        ]
        for extra, needle in bad:
            with pytest.raises(EngineError) as e:
                engine.call("set_adapter_state", {"adapter_id": "x", "weights": new_weights, **extra})
            assert e.value.code == INVALID_ARGUMENT and needle in e.value.message, (needle, e.value.message)
            after = engine.call("get_adapter_state", {"adapter_id": "x"})
            for part in ("weights", "grads", "optimizer"):
                assert max_abs_diff(after[part], before[part]) == 0.0, (needle, part)
            assert after["micro_batches_since_step"] == 1 and after["optimizer_kind"] == "adamw"
        # An empty grads map is a restore of "no gradients"; an absent one keeps them.
        engine.call("set_adapter_state", {"adapter_id": "x", "weights": {}})
        assert engine.call("get_adapter_state", {"adapter_id": "x"})["grads"]
        engine.call("set_adapter_state", {"adapter_id": "x", "grads": {}})
        assert engine.call("get_adapter_state", {"adapter_id": "x"})["grads"] == {}


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
