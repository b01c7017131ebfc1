"""Fusion never changes a tenant's numbers: adapters trained together in one fused pass end
exactly where each would end trained alone on the same data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load
from engine_harness import Engine
from numerics import assert_close

ADAPTERS = {"a": 2, "b": 4, "c": 8}  # id -> rank
ROUNDS = 20
HYPER = {"learning_rate": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.01}


def data(adapter: str, round_: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(ord(adapter) * 1000 + round_)
    out = []
    for n in (5 + ord(adapter) % 3, 11):
        tokens = torch.randint(0, 256, (n,), generator=g)
        out.append({"input_tokens": tokens, "target_tokens": torch.roll(tokens, -1),
                    "inputs": {"weights": torch.rand(n, generator=g)}})
    return out


def base_rows(round_: int) -> dict[str, object]:
    g = torch.Generator().manual_seed(1000 + round_)
    tokens = torch.randint(0, 256, (13,), generator=g)
    return {"adapter_id": "", "datums": [{"input_tokens": tokens, "target_tokens": tokens}]}


def create(engine: Engine, adapter: str, dropout: float = 0.0) -> None:
    engine.call("create_adapter", {"adapter_id": adapter, "rank": ADAPTERS[adapter], "alpha": 16.0,
                                   "seed": ord(adapter), "dropout": dropout})


def op(adapter: str, round_: int) -> dict[str, object]:
    return {"adapter_id": adapter, "datums": data(adapter, round_), "loss": {"name": "cross_entropy"}}


@pytest.mark.parametrize("dropout,rounds", [(0.0, ROUNDS), (0.1, 5)], ids=["no-dropout", "dropout"])
def test_fused_training_equals_solo_training(reference_models: Path, dropout: float, rounds: int) -> None:
    """With dropout the masks come from each adapter's own seeded stream, so fused and solo
    draw the same masks and still end identical."""
    model_dir = reference_models / "qwen3"
    with Engine() as fused:
        load(fused, model_dir)
        for a in ADAPTERS:
            create(fused, a, dropout)
        for r in range(rounds):
            # One request: three adapters' ops plus base-only rows, one base-model pass.
            ops = [op(a, r) for a in ADAPTERS]
            ops.insert(1, base_rows(r))
            fused.call("forward", {"ops": [base_rows(r)]})  # a base-only forward in between
            reply = fused.call("forward_backward", {"ops": ops})
            assert len(reply["ops"]) == len(ops)
            for a in ADAPTERS:
                fused.call("optim_step", {"adapter_id": a, "hyper": HYPER})
        fused_state = {a: fused.call("get_adapter_state", {"adapter_id": a}) for a in ADAPTERS}

    for a in ADAPTERS:
        with Engine() as solo:
            load(solo, model_dir)
            create(solo, a, dropout)
            for r in range(rounds):
                solo.call("forward_backward", {"ops": [op(a, r)]})
                solo.call("optim_step", {"adapter_id": a, "hyper": HYPER})
            solo_state = solo.call("get_adapter_state", {"adapter_id": a})
        assert fused_state[a]["step"] == solo_state["step"] == rounds
        # Training moved every B away from its zero init, so equality is not trivially true.
        assert all(float(w.abs().max()) > 0 for n, w in solo_state["weights"].items() if "lora_B" in n)
        for name, w in solo_state["weights"].items():
            assert_close(f"{a} {name}", fused_state[a]["weights"][name], w, 1e-6, absolute=True)
        for name, m in solo_state["optimizer"].items():
            if m.is_floating_point():
                assert_close(f"{a} optimizer {name}", fused_state[a]["optimizer"][name], m, 1e-5)


def test_dropout_changes_the_gradient(reference_models: Path) -> None:
    """Guards the test above: with dropout on, the gradient differs from the dropout-free one
    (so equal fused/solo results are not an artefact of dropout being ignored)."""
    with Engine() as engine:
        load(engine, reference_models / "qwen3")
        create(engine, "a", 0.0)
        engine.call("create_adapter", {"adapter_id": "d", "rank": ADAPTERS["a"], "alpha": 16.0,
                                       "seed": ord("a"), "dropout": 0.5})
        grads = {}
        for adapter in ("a", "d"):
            engine.call("forward_backward", {"ops": [{**op("a", 0), "adapter_id": adapter}]})
            grads[adapter] = engine.call("get_adapter_state", {"adapter_id": adapter})["grads"]
    name = next(n for n in grads["a"] if "lora_B" in n)  # lora_A grads are 0 while B = 0
    assert float(grads["a"][name].abs().max()) > 0
    assert not torch.allclose(grads["a"][name], grads["d"][name])


def test_gradient_accumulation_equals_one_big_batch(reference_models: Path) -> None:
    """Tinker losses are plain sums: two forward_backward calls before optim_step give the same
    step as one call with all the datums."""
    model_dir = reference_models / "qwen3"
    d0, d1 = data("b", 0), data("b", 1)
    states = []
    for calls in ([d0, d1], [d0 + d1]):
        with Engine() as engine:
            load(engine, model_dir)
            create(engine, "b")
            for datums in calls:
                engine.call("forward_backward", {"ops": [{"adapter_id": "b", "datums": datums,
                                                          "loss": {"name": "cross_entropy"}}]})
            engine.call("optim_step", {"adapter_id": "b", "hyper": HYPER})
            states.append(engine.call("get_adapter_state", {"adapter_id": "b"}))
    for name, w in states[1]["weights"].items():
        assert_close(f"accumulated {name}", states[0]["weights"][name], w, 1e-6, absolute=True)
