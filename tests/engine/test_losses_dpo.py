"""Twinkle's DPO loss (core/engine/loss/twinkle_preference_losses.cc) against the formula, through loss_probe.

The datums of one call are interleaved [chosen_0, rejected_0, chosen_1, rejected_1, ...]. The engine's total,
per-token "elementwise" contributions and d total / d logprobs are compared with a direct float64 PyTorch
computation of twinkle-api.md §6 written out below (DPOLoss: sequence log-probs π = Σ mask·lp, reference
ρ = Σ mask·ref_logprobs, z = β·((π_c − ρ_c) − (π_r − ρ_r)), mean over pairs, plus sft_weight · CE(chosen)).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_harness import Engine, EngineError
from numerics import assert_close

INVALID_ARGUMENT = 3


@pytest.fixture(scope="module")
def loss_engine() -> Iterator[Engine]:
    with Engine() as e:
        yield e


# ---------------------------------------------------------------- reference formula (float64)


def dpo_reference(config: dict[str, Any], datums: list[dict[str, Any]], context: dict[str, int]
                  ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor], dict[str, float]]:
    """Returns (total, per-token contributions, d total / d logprobs, metrics)."""
    lps = [d["logprobs"].to(torch.float64).clone().requires_grad_(True) for d in datums]
    ins = [{k: v.to(torch.float64) for k, v in d["inputs"].items()} for d in datums]
    masks = [x.get("mask", torch.ones_like(lp)) * x.get("weights", torch.ones_like(lp)) for lp, x in zip(lps, ins)]
    beta = config.get("beta", 0.1)
    eps = config.get("label_smoothing", 0.0)
    loss_type = config.get("loss_type", "sigmoid")
    sft_weight = config.get("sft_weight", 0.0)
    n = len(lps)
    pairs = n // 2

    pi = torch.stack([(lp * m).sum() for lp, m in zip(lps, masks)])
    if config.get("reference_free", False):
        delta = pi
    else:
        delta = pi - torch.stack([(x["ref_logprobs"] * m).sum() for x, m in zip(ins, masks)])
    dc, dr = delta[0::2], delta[1::2]
    z = beta * (dc - dr)
    if loss_type == "sigmoid":
        losses = (1 - eps) * -F.logsigmoid(z) + eps * -F.logsigmoid(-z)
    elif loss_type == "hinge":
        losses = torch.relu(1 - z)
    elif loss_type == "ipo":
        losses = (z - 1 / (2 * beta)) ** 2
    else:
        assert loss_type == "kto_pair"
        losses = 1 - torch.sigmoid(beta * dc) + torch.sigmoid(beta * dr)
    window_pairs = (context.get("window_sequences") or n) // 2
    total = losses.sum() / window_pairs

    # Elementwise: each pair's share spread evenly over its counted tokens (all its tokens if none counts).
    shares = losses.detach() / window_pairs
    counted = [int((m != 0).sum()) for m in masks]
    terms = []
    for i in range(n):
        c = i - i % 2
        pair_counted, pair_length = counted[c] + counted[c + 1], len(lps[c]) + len(lps[c + 1])
        if pair_counted > 0:
            terms.append((masks[i] != 0).to(torch.float64) * shares[i // 2] / pair_counted)
        else:
            terms.append(torch.ones_like(masks[i]) * shares[i // 2] / max(pair_length, 1))
    metrics = {"reward_margin:mean": float(z.detach().mean()), "reward_accuracy:mean": float((z > 0).double().mean()),
               "num_tokens:sum": float(sum(counted)), "num_sequences:sum": float(n)}
    if sft_weight > 0:
        chosen_tokens = max(sum(counted[0::2]), 1)
        sft = [-lps[c] * masks[c] / chosen_tokens for c in range(0, n, 2)]
        metrics["sft_loss:mean"] = float(sum(t.detach().sum() for t in sft))
        for c, t in zip(range(0, n, 2), sft):
            weighted = sft_weight * (pairs / window_pairs) * t
            total = total + weighted.sum()
            terms[c] = terms[c] + weighted.detach()
    total.backward()
    return total.detach(), terms, [lp.grad for lp in lps], metrics


# ---------------------------------------------------------------- random pairs

# Datum lengths, pairwise: an empty chosen sequence, a long pair, a pair of single tokens.
LENGTHS = [3, 5, 17, 1, 0, 4, 64, 9, 2, 2, 1, 1, 6, 30]


def make_pairs(case: dict[str, Any], dtype: torch.dtype, seed: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    ref_spread = case.get("ref_spread", 0.5)
    datums = []
    for i, n in enumerate(case.get("lengths", LENGTHS)):
        lp = -3 * torch.rand(n, generator=g, dtype=torch.float64)
        x: dict[str, torch.Tensor] = {}
        for key in case["inputs"]:
            if key == "ref_logprobs":
                x[key] = lp + ref_spread * torch.randn(n, generator=g, dtype=torch.float64)
            elif key in ("mask", "mask_weights"):  # 0/1
                x["mask" if key == "mask" else "weights"] = (torch.rand(n, generator=g) < 0.7).to(torch.float64)
            else:
                raise AssertionError(key)
        if "mask" in x and i // 2 == case.get("unmasked_pair", -1):  # no token of this pair counts
            x["mask"] = torch.zeros(n, dtype=torch.float64)
        datums.append({"logprobs": lp.to(dtype), "inputs": {k: v.to(dtype) for k, v in x.items()}})
    return datums


REF = ["ref_logprobs"]
SEED64, SEED32 = 11, 12  # seeds whose pairs fall on both sides of the hinge and of z = 0
CASES: dict[str, dict[str, Any]] = {
    "sigmoid": {"config": {}, "inputs": REF + ["mask"]},
    "sigmoid_smoothing_sft": {"config": {"beta": 0.2, "label_smoothing": 0.1, "sft_weight": 0.5},
                              "inputs": REF + ["mask", "mask_weights"]},
    "sigmoid_unmasked_pair": {"config": {"beta": 0.3}, "inputs": REF + ["mask"], "unmasked_pair": 4},
    "hinge": {"config": {"beta": 0.5, "loss_type": "hinge"}, "inputs": REF + ["mask"], "ref_spread": 1.0},
    "ipo": {"config": {"beta": 0.3, "loss_type": "ipo"}, "inputs": REF + ["mask"]},
    "kto_pair": {"config": {"beta": 0.2, "loss_type": "kto_pair"}, "inputs": REF + ["mask"]},
    "reference_free_sft": {"config": {"reference_free": True, "sft_weight": 1.0}, "inputs": ["mask"]},
    "window_sft": {"config": {"beta": 0.2, "sft_weight": 2.0}, "inputs": REF + ["mask"],
                   "context": {"window_tokens": 0, "window_sequences": 20}},
}


def probe(engine: Engine, case: dict[str, Any], datums: list[dict[str, Any]]) -> dict[str, Any]:
    context = case.get("context", {"window_tokens": 0, "window_sequences": 0})
    return engine.call("loss_probe", {"loss": {"name": "twinkle:dpo", "config": case["config"]},
                                      "datums": datums, "context": context})


def check(engine: Engine, label: str, case: dict[str, Any], dtype: torch.dtype, tol: float, absolute: bool,
          seed: int) -> None:
    datums = make_pairs(case, dtype, seed)
    got = probe(engine, case, datums)
    total, terms, grads, metrics = dpo_reference(case["config"], datums, case.get("context", {}))
    got_total = torch.tensor([got["total"]], dtype=torch.float64)
    largest = [assert_close(f"{label} total", got_total, total.reshape(1), tol, absolute)]
    assert len(got["elementwise"]) == len(got["grad_logprobs"]) == len(datums)
    for i, (e, g) in enumerate(zip(got["elementwise"], got["grad_logprobs"])):
        assert e.dtype == g.dtype == dtype
        largest.append(assert_close(f"{label} datum{i} elementwise", e, terms[i], tol, absolute))
        largest.append(assert_close(f"{label} datum{i} grad", g, grads[i], tol, absolute))
    # Elementwise sums to the total (every pair here has at least one token).
    elementwise_sum = sum(float(e.double().sum()) for e in got["elementwise"])
    assert elementwise_sum == pytest.approx(got["total"], rel=tol * 10, abs=tol * 10)
    assert got["metrics"]["loss:mean"] == pytest.approx(got["total"], rel=1e-12, abs=1e-300)
    for key, want in metrics.items():
        assert got["metrics"][key] == pytest.approx(want, rel=tol * 10, abs=tol * 10), key
    assert all(key.count(":") == 1 for key in got["metrics"])
    print(f"{label}: largest difference {max(largest):.3e}")


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_float64_matches_formula(loss_engine: Engine, case_id: str) -> None:
    check(loss_engine, case_id, CASES[case_id], torch.float64, 1e-10, absolute=True, seed=SEED64)


@pytest.mark.parametrize("case_id", ["sigmoid_smoothing_sft", "hinge", "ipo", "kto_pair", "window_sft"])
def test_float32_matches_formula(loss_engine: Engine, case_id: str) -> None:
    check(loss_engine, f"{case_id} fp32", CASES[case_id], torch.float32, 1e-5, absolute=False, seed=SEED32)


def test_inputs_cover_both_sides_of_the_hinge_and_both_preferences() -> None:
    # Guards the inputs themselves: the hinge must be active on some pairs and flat on others.
    for (case_id, threshold), seed in itertools.product([("hinge", 1.0), ("sigmoid", 0.0)], [SEED64, SEED32]):
        case = CASES[case_id]
        datums = make_pairs(case, torch.float64, seed)
        delta = torch.stack([((d["logprobs"] - d["inputs"]["ref_logprobs"]) * d["inputs"]["mask"]).sum()
                             for d in datums])
        z = case["config"].get("beta", 0.1) * (delta[0::2] - delta[1::2])
        assert (z > threshold).any() and (z < threshold).any(), (case_id, seed, z)


# ---------------------------------------------------------------- errors


def expect_error(engine: Engine, config: dict[str, Any], datums: list[dict[str, Any]], *needles: str,
                 context: dict[str, int] | None = None) -> None:
    body = {"loss": {"name": "twinkle:dpo", "config": config}, "datums": datums}
    if context is not None:
        body["context"] = context
    with pytest.raises(EngineError) as err:
        engine.call("loss_probe", body)
    print(f"error: {err.value.message}")
    assert err.value.code == INVALID_ARGUMENT, err.value
    for needle in needles:
        assert needle in err.value.message


def datum(**inputs: torch.Tensor) -> dict[str, Any]:
    return {"logprobs": torch.tensor([-1.0, -2.0], dtype=torch.float64), "inputs": inputs}


def test_errors(loss_engine: Engine) -> None:
    ref = torch.tensor([-1.5, -2.5], dtype=torch.float64)
    pair = [datum(ref_logprobs=ref), datum(ref_logprobs=ref)]
    expect_error(loss_engine, {}, pair + [datum(ref_logprobs=ref)], "even number of datums", "got 3")
    expect_error(loss_engine, {}, [datum(ref_logprobs=ref), datum()], "datum 1",
                 "missing input 'ref_logprobs' (required unless reference_free)")
    expect_error(loss_engine, {"loss_type": "kto"}, pair, "loss_type must be one of", "'kto_pair'")
    expect_error(loss_engine, {"loss_type": "hinge", "label_smoothing": 0.1}, pair,
                 "label_smoothing > 0 needs loss_type 'sigmoid'")
    expect_error(loss_engine, {"beta": 0}, pair, "beta must be > 0")
    expect_error(loss_engine, {"reference_free": 2}, pair, "reference_free must be 0 or 1")
    expect_error(loss_engine, {"rpo_alpha": 1.0}, pair, "unknown config key 'rpo_alpha'", "'loss_type'")
    expect_error(loss_engine, {}, pair, "window_sequences must be even",
                 context={"window_tokens": 0, "window_sequences": 3})
    expect_error(loss_engine, {}, [datum(ref_logprobs=ref, mask=torch.tensor([1.0, 0.5], dtype=torch.float64)),
                                   datum(ref_logprobs=ref)], "must be 0 or 1")


def test_reference_free_accepts_and_ignores_ref_logprobs(loss_engine: Engine) -> None:
    ref = torch.tensor([-1.5, -2.5], dtype=torch.float64)
    with_ref = probe(loss_engine, {"config": {"reference_free": True}},
                     [datum(ref_logprobs=ref), datum(ref_logprobs=ref)])
    without = probe(loss_engine, {"config": {"reference_free": True}}, [datum(), datum()])
    assert with_ref["total"] == without["total"] == pytest.approx(math.log(2), abs=1e-15)
