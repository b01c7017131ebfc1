"""Twinkle-native optimizer control through the engine's IPC: clip_grad_norm, optim_step
without zero_grad, set_optimizer. References: torch.nn.utils.clip_grad_norm_ on the engine's
own gradients, and PEFT + torch.optim stepping the same model on the same data."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import load
from engine_harness import Engine, EngineError
from numerics import assert_close, relative_norm_error
from test_fused import data
from test_model import ALL_LINEAR, hf_logits, peft_model, random_lora_state

INVALID_ARGUMENT = 3
RANK, ALPHA = 4, 8.0
SGD = {"learning_rate": 0.05, "momentum": 0.9, "weight_decay": 0.01}


def engine_order(name: str) -> tuple[int, int, bool]:
    """The engine's (and PEFT's) parameter order: layer by layer, linears in model order,
    lm_head last, A before B. Replies carry maps sorted by key, so tests re-order."""
    layer = re.search(r"layers\.(\d+)\.", name)
    kind = next(i for i, k in enumerate(ALL_LINEAR + ["lm_head"]) if f".{k}." in name)
    return (int(layer[1]) if layer else 1 << 30, kind, "lora_B" in name)


def setup(engine: Engine, model_dir: Path, optimizer: str = "adamw") -> dict[str, torch.Tensor]:
    """Adapter "t" with random non-zero A and B (so every gradient is non-zero); returns them."""
    load(engine, model_dir)
    engine.call("create_adapter", {"adapter_id": "t", "rank": RANK, "alpha": ALPHA, "seed": 3,
                                   "optimizer": optimizer})
    weights = random_lora_state(engine, "t", seed=4)
    engine.call("set_adapter_state", {"adapter_id": "t", "weights": weights})
    return weights


def state(engine: Engine) -> dict[str, Any]:
    return engine.call("get_adapter_state", {"adapter_id": "t"})


def backward(engine: Engine, round_: int) -> None:
    engine.call("forward_backward", {"ops": [{"adapter_id": "t", "datums": data("a", round_),
                                              "loss": {"name": "cross_entropy"}}]})


def peft_backward(peft: torch.nn.Module, round_: int) -> None:
    """The engine's cross_entropy (sum of -weight * logprob) on the same datums, backward."""
    total = torch.zeros(())
    for d in data("a", round_):
        lp = torch.log_softmax(hf_logits(peft, d["input_tokens"]), -1)
        lp = lp.gather(1, d["target_tokens"].unsqueeze(1)).squeeze(1)
        total = total + (-(d["inputs"]["weights"] * lp)).sum()
    total.backward()


def lora_params(peft: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """PEFT's trainable parameters under the engine's keys, in the engine's order."""
    params = {k.replace(".default", ""): p for k, p in peft.named_parameters() if p.requires_grad}
    return dict(sorted(params.items(), key=lambda kv: engine_order(kv[0])))


@pytest.mark.parametrize("norm_type,factor", [(2.0, 0.5), (math.inf, 0.5), (2.0, 2.0)],
                         ids=["l2-clipped", "inf-clipped", "l2-not-clipped"])
def test_clip_grad_norm_matches_torch(reference_models: Path, norm_type: float, factor: float) -> None:
    with Engine() as engine:
        setup(engine, reference_models / "qwen3")
        backward(engine, 0)
        before = state(engine)["grads"]
        names = sorted(before, key=engine_order)
        # torch.nn.utils.clip_grad_norm_ on the very same gradients, in the same order.
        params = [torch.zeros_like(before[n], requires_grad=True) for n in names]
        for p, n in zip(params, names):
            p.grad = before[n].clone()
        full_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params], norm_type))
        max_norm = factor * full_norm
        ref_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type))

        reply = engine.call("clip_grad_norm", {"adapter_id": "t", "max_norm": max_norm, "norm_type": norm_type})
        after = state(engine)["grads"]
        err = abs(reply["total_norm"] - ref_norm) / ref_norm
        print(f"clip_grad_norm norm_type={norm_type} factor={factor}: total norm rel diff = {err:.3e}")
        assert err <= 1e-6
        for p, n in zip(params, names):
            assert_close(f"clipped {n}", after[n], p.grad, 1e-6)
            if factor >= 1:  # torch multiplies by exactly 1.0: the gradients stay bit for bit
                assert torch.equal(after[n], before[n])

        # optim_step reads the clipped gradients: its reported L2 norm is theirs.
        step = engine.call("optim_step", {"adapter_id": "t", "hyper": {"learning_rate": 1e-3}})
        clipped_l2 = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
        err = abs(step["grad_norm"] - clipped_l2) / clipped_l2
        print(f"optim_step after clip: grad_norm rel diff = {err:.3e}")
        assert err <= 1e-6


def test_clip_grad_norm_errors(reference_models: Path) -> None:
    with Engine() as engine:
        setup(engine, reference_models / "qwen3")
        assert engine.call("clip_grad_norm", {"adapter_id": "t"})["total_norm"] == 0.0  # no gradients yet
        backward(engine, 0)
        before = state(engine)["grads"]
        for body, needle in [({"norm_type": 1}, "norm_type must be 2 or inf, got 1"),
                             ({"norm_type": -math.inf}, "norm_type"),
                             ({"max_norm": -1.0}, "max_norm must be >= 0")]:
            with pytest.raises(EngineError) as e:
                engine.call("clip_grad_norm", {"adapter_id": "t", **body})
            assert e.value.code == INVALID_ARGUMENT and needle in e.value.message, e.value.message
        after = state(engine)["grads"]
        assert all(torch.equal(after[n], g) for n, g in before.items())


def test_step_without_zero_grad_accumulates_like_torch(reference_models: Path) -> None:
    """Twinkle's step() keeps the gradients: the next backward adds to them and the second step
    applies the sum, exactly what torch does without zero_grad between the steps."""
    model_dir = reference_models / "qwen3"
    with Engine() as engine:
        weights = setup(engine, model_dir, optimizer="SGD")
        backward(engine, 0)
        g0 = state(engine)["grads"]
        first = engine.call("optim_step", {"adapter_id": "t", "hyper": SGD, "zero_grad": False})
        kept = state(engine)
        backward(engine, 1)
        accumulated = state(engine)["grads"]
        second = engine.call("optim_step", {"adapter_id": "t", "hyper": SGD})  # zero_grad defaults to true
        final = state(engine)
    assert (first["step"], second["step"]) == (1, 2)
    assert set(kept["grads"]) == set(g0) and all(torch.equal(kept["grads"][n], g) for n, g in g0.items())
    assert final["grads"] == {} and final["micro_batches_since_step"] == 0

    peft = peft_model(model_dir, RANK, ALPHA, weights)
    params = lora_params(peft)
    opt = torch.optim.SGD(params.values(), lr=SGD["learning_rate"], momentum=SGD["momentum"],
                          weight_decay=SGD["weight_decay"], foreach=False)
    peft_backward(peft, 0)
    opt.step()
    peft_backward(peft, 1)  # no zero_grad: accumulates onto the first gradients
    for name, p in params.items():
        relative_norm_error(f"accumulated grad {name}", accumulated[name], p.grad, 1e-5)
    opt.step()
    largest = max(assert_close(f"weight {name}", final["weights"][name], p, 1e-6, absolute=True)
                  for name, p in params.items())
    print(f"step without zero_grad: largest |weight diff| = {largest:.3e}")


def test_set_optimizer_switches_to_sgd_like_torch(reference_models: Path) -> None:
    """AdamW for a step, then set_optimizer("SGD") with gradients pending: the pending
    gradients survive, the SGD state starts fresh at step 0, and the next steps match
    torch.optim.SGD started from the same weights."""
    model_dir = reference_models / "qwen3"
    with Engine() as engine:
        setup(engine, model_dir)
        backward(engine, 0)
        engine.call("optim_step", {"adapter_id": "t", "hyper": {"learning_rate": 1e-2}})
        backward(engine, 1)
        before = state(engine)
        engine.call("set_optimizer", {"adapter_id": "t", "optimizer": "SGD"})
        switched = state(engine)
        with pytest.raises(EngineError) as e:
            engine.call("set_optimizer", {"adapter_id": "t", "optimizer": "lion"})
        assert e.value.code == INVALID_ARGUMENT and "unknown optimizer 'lion'" in e.value.message
        assert state(engine)["optimizer_kind"] == "sgd"  # a refused kind changes nothing
        steps = [engine.call("optim_step", {"adapter_id": "t", "hyper": SGD})["step"]]
        backward(engine, 2)
        steps.append(engine.call("optim_step", {"adapter_id": "t", "hyper": SGD})["step"])
        final = state(engine)
    assert before["optimizer_kind"] == "adamw" and before["step"] == 1
    assert switched["optimizer_kind"] == "sgd" and switched["config"]["optimizer"] == "sgd"
    assert switched["step"] == 0 and set(switched["optimizer"]) == {"step"}  # no momentum buffers yet
    assert all(torch.equal(switched["grads"][n], g) for n, g in before["grads"].items())
    assert steps == [1, 2]

    peft = peft_model(model_dir, RANK, ALPHA, before["weights"])
    params = lora_params(peft)
    opt = torch.optim.SGD(params.values(), lr=SGD["learning_rate"], momentum=SGD["momentum"],
                          weight_decay=SGD["weight_decay"], foreach=False)
    peft_backward(peft, 1)
    opt.step()
    opt.zero_grad()
    peft_backward(peft, 2)
    opt.step()
    weight_diff = momentum_diff = 0.0
    for i, (name, p) in enumerate(params.items()):
        weight_diff = max(weight_diff, assert_close(f"weight {name}", final["weights"][name], p, 1e-6,
                                                    absolute=True))
        momentum_diff = max(momentum_diff, assert_close(
            f"momentum {name}", final["optimizer"][f"momentum_buffer.{i}"], opt.state[p]["momentum_buffer"], 1e-5))
    print(f"set_optimizer SGD: largest |weight diff| = {weight_diff:.3e}, "
          f"largest |momentum diff| = {momentum_diff:.3e}")
