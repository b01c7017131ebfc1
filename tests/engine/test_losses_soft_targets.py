"""Soft-target cross-entropy: target_tokens and weights of shape [N, K] (Tinker's top-k
distillation, docs/losses.md), loss = -sum_{n,k} weights[n, k] * log p(target[n, k] | x_<=n).

1. The loss code alone (loss_probe) against that formula in float64 and float32, values and
   gradients with respect to the [N, K] log-probs.
2. The whole engine path (forward_backward on a tiny model with a LoRA adapter) against PEFT:
   the [N, K] log-probs, loss:sum and every LoRA gradient, with a 1-D datum in the same batch
   (the engine pads the targets to one width and hands each datum back its own).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import load
from engine_harness import Engine, EngineError
from numerics import assert_close, relative_norm_error
from test_model import ALL_LINEAR, peft_model, random_lora_state, sequences

INVALID_ARGUMENT = 3


@pytest.fixture(scope="module")
def loss_engine() -> Iterator[Engine]:
    with Engine() as e:
        yield e


def soft_datums(dtype: torch.dtype, seed: int) -> list[dict[str, object]]:
    g = torch.Generator().manual_seed(seed)
    datums = []
    for n, k in [(5, 3), (1, 3), (17, 3), (0, 3)]:
        lp = -3 * torch.rand(n, k, generator=g, dtype=torch.float64)
        w = torch.softmax(torch.randn(n, k, generator=g, dtype=torch.float64), -1)
        w[torch.rand(n, generator=g) < 0.3] = 0  # positions that do not count
        datums.append({"logprobs": lp.to(dtype), "inputs": {"weights": w.to(dtype)}})
    return datums


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_soft_target_cross_entropy_matches_formula(loss_engine: Engine, dtype: torch.dtype, tol: float) -> None:
    datums = soft_datums(dtype, seed=3)
    got = loss_engine.call("loss_probe", {"loss": {"name": "cross_entropy", "config": {}}, "datums": datums,
                                          "context": {"window_tokens": 0, "window_sequences": 0}})
    total = torch.zeros((), dtype=torch.float64)
    counted = 0
    for i, d in enumerate(datums):
        lp = d["logprobs"].to(torch.float64).clone().requires_grad_(True)
        w = d["inputs"]["weights"].to(torch.float64)
        term = -w * lp
        term.sum().backward()
        total = total + term.sum().detach()
        counted += int((w.abs().sum(1) != 0).sum())
        assert got["elementwise"][i].shape == lp.shape and got["elementwise"][i].dtype == dtype
        assert_close(f"datum{i} elementwise", got["elementwise"][i], term, tol)
        assert_close(f"datum{i} grad", got["grad_logprobs"][i], lp.grad, tol)
    assert_close("total", torch.tensor([got["total"]], dtype=torch.float64), total.reshape(1), tol)
    assert got["metrics"]["num_tokens:sum"] == counted  # positions with any nonzero weight


def test_soft_targets_only_for_cross_entropy(loss_engine: Engine) -> None:
    d = {"logprobs": torch.zeros(2, 3, dtype=torch.float64),
         "inputs": {"logprobs": torch.zeros(2, 3, dtype=torch.float64),
                    "advantages": torch.ones(2, 3, dtype=torch.float64)}}
    with pytest.raises(EngineError) as err:
        loss_engine.call("loss_probe", {"loss": {"name": "ppo", "config": {}}, "datums": [d]})
    assert err.value.code == INVALID_ARGUMENT
    assert "only accepted by cross_entropy" in err.value.message
    d = {"logprobs": torch.zeros(2, 3, dtype=torch.float64), "inputs": {"weights": torch.ones(2, dtype=torch.float64)}}
    with pytest.raises(EngineError) as err:
        loss_engine.call("loss_probe", {"loss": {"name": "cross_entropy", "config": {}}, "datums": [d]})
    assert "'weights' has shape [2], expected [2, 3]" in err.value.message


def test_soft_targets_through_the_model_match_peft(engine: Engine, reference_models: Path) -> None:
    model_dir = reference_models / "qwen3"
    load(engine, model_dir)
    rank, alpha = 4, 8.0
    engine.call("create_adapter", {"adapter_id": "t", "rank": rank, "alpha": alpha, "seed": 3})
    weights = random_lora_state(engine, "t", seed=4)
    engine.call("set_adapter_state", {"adapter_id": "t", "weights": weights})
    peft = peft_model(model_dir, rank, alpha, weights, ALL_LINEAR)

    seqs = sequences(256, [9, 30, 6], seed=5)
    g = torch.Generator().manual_seed(6)
    # Datum 0: K = 4, datum 1: K = 2 (padded to 4 inside the engine), datum 2: plain [N] targets.
    targets = [torch.randint(0, 256, (9, 4), generator=g), torch.randint(0, 256, (30, 2), generator=g),
               torch.randint(0, 256, (6,), generator=g)]
    loss_weights = [torch.rand(t.shape, generator=g) for t in targets]
    datums = [{"input_tokens": s, "target_tokens": t, "inputs": {"weights": w}}
              for s, t, w in zip(seqs, targets, loss_weights)]
    reply = engine.call("forward_backward", {"ops": [{"adapter_id": "t", "datums": datums,
                                                      "loss": {"name": "cross_entropy"}}]})
    grads = engine.call("get_adapter_state", {"adapter_id": "t"})["grads"]

    total = torch.zeros((), dtype=torch.float64)
    for i, (s, t, w) in enumerate(zip(seqs, targets, loss_weights)):
        logsm = torch.log_softmax(peft(input_ids=s.unsqueeze(0)).logits[0], -1)
        lp = logsm.gather(1, t) if t.dim() == 2 else logsm.gather(1, t.unsqueeze(1)).squeeze(1)
        got = reply["ops"][0]["logprobs"][i]
        assert got.shape == t.shape
        assert_close(f"datum{i} logprobs {tuple(t.shape)}", got, lp, 1e-5)
        assert_close(f"datum{i} elementwise", reply["ops"][0]["elementwise"][i], -(w * lp), 1e-5)
        total = total + (-(w * lp)).sum()
    total.backward()
    ref_grads = {k.replace(".default", ""): p.grad for k, p in peft.named_parameters() if p.grad is not None}
    assert set(ref_grads) == set(grads)
    for name, ref in ref_grads.items():
        relative_norm_error(f"grad {name}", grads[name], ref, 1e-5)
    assert abs(reply["ops"][0]["metrics"]["loss:sum"] - float(total)) <= 1e-5 * abs(float(total))
