"""The engine's losses (core/engine/loss) against the published formulas, through loss_probe.

Every loss is computed by the C++ engine on random inputs (several datums of different lengths,
advantages of both signs, sampler log-probs near the current ones so that ratios straddle the
clip thresholds) and compared with a direct float64 PyTorch computation of the formula from
tinker-protocol.md §9 / twinkle-api.md §6, written out below; gradients come from autograd on
both sides. "elementwise" is each token's contribution to the total (normalisers included).
Twinkle's DPO (sequence-level, paired datums) is in test_losses_dpo.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from engine_harness import Engine, EngineError
from numerics import assert_close

INVALID_ARGUMENT = 3


@pytest.fixture(scope="module")
def loss_engine() -> Iterator[Engine]:
    # loss_probe needs no model, so one worker serves the whole module.
    with Engine() as e:
        yield e


# ---------------------------------------------------------------- reference formulas (float64)


def reference(name: str, config: dict[str, Any], datums: list[dict[str, Any]],
              context: dict[str, int]) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Returns (total, per-token contributions, d total / d logprobs) per datum."""
    lps = [d["logprobs"].to(torch.float64).clone().requires_grad_(True) for d in datums]
    ins = [{k: v.to(torch.float64) for k, v in d["inputs"].items()} for d in datums]
    if name.startswith("twinkle:"):
        terms = twinkle_terms(name, config, lps, ins, context)
    else:
        terms = [tinker_term(name, config, lp, x) for lp, x in zip(lps, ins)]
    total = sum(t.sum() for t in terms)
    total.backward()
    return total.detach(), [t.detach() for t in terms], [lp.grad for lp in lps]


def tinker_term(name: str, config: dict[str, Any], lp: torch.Tensor, x: dict[str, torch.Tensor]) -> torch.Tensor:
    """tinker-protocol.md §9.2: per-token term of the plain-sum losses (weights multiply)."""
    w = x.get("weights", torch.ones_like(lp))
    if name == "cross_entropy":
        return -w * lp
    q, a = x["logprobs"], x["advantages"]
    r = torch.exp(lp - q)
    if name == "importance_sampling":
        return -(r * a) * w
    if name in ("ppo", "cispo"):
        lo_default, hi_default = (0.8, 1.2) if name == "ppo" else (0.0, 4.0)
        lo = x.get("clip_low_threshold", torch.full_like(lp, config.get("clip_low_threshold", lo_default)))
        hi = x.get("clip_high_threshold", torch.full_like(lp, config.get("clip_high_threshold", hi_default)))
        clipped = torch.clamp(r, lo, hi)
        if name == "ppo":
            return -torch.minimum(r * a, clipped * a) * w
        return -(clipped.detach() * lp * a) * w
    if name == "dro":
        beta = config.get("beta", 0.05)
        return -(lp * a - 0.5 * beta * (lp - q) ** 2) * w
    if name == "gspo":
        # Tinker's GSPO-token page: s = exp(mean over M of log(p/q)), M = sequence_ratio_mask != 0
        # (docs/losses.md: every token without one, s = 1 when M is empty); value of s with the
        # gradient of each token's own log-prob.
        m = x["sequence_ratio_mask"] != 0 if "sequence_ratio_mask" in x else torch.ones_like(lp, dtype=torch.bool)
        log_s = (lp.detach() - q)[m].mean() if bool(m.any()) else torch.zeros((), dtype=lp.dtype)
        s_t = torch.exp(log_s + lp - lp.detach())
        lo = config.get("clip_low_threshold", 1 - 3e-4)
        hi = config.get("clip_high_threshold", 1 + 4e-4)
        return -torch.minimum(s_t * a, torch.clamp(s_t, lo, hi) * a) * w
    if name == "stable_reinforce":
        # docs/losses.md: truncated importance weight on REINFORCE, plus a k3 KL to the sampler.
        w = w * x.get("stability_mask", torch.ones_like(lp))
        cap = config.get("clip_high_threshold", 2.0)
        term = -(torch.clamp(torch.exp(lp.detach() - q), max=cap) * a * lp)
        kl = config.get("kl_coeff", 0.0)
        if kl > 0:
            diff = q - lp
            term = term + kl * (torch.exp(diff) - diff - 1)
        return term * w
    raise AssertionError(name)


def twinkle_terms(name: str, config: dict[str, Any], lps: list[torch.Tensor],
                  ins: list[dict[str, torch.Tensor]], context: dict[str, int]) -> list[torch.Tensor]:
    """twinkle-api.md §6: masked means; normalisers may span the accumulation window."""
    masks = [x.get("mask", torch.ones_like(lp)) * x.get("weights", torch.ones_like(lp)) for lp, x in zip(lps, ins)]
    if name == "twinkle:cross_entropy":
        terms = [-lp * m for lp, m in zip(lps, masks)]
        if config.get("reduction", "mean") == "sum":
            return terms
        denom = context.get("window_tokens") or max(float(sum(m.sum() for m in masks)), 1.0)
        return [t / denom for t in terms]
    assert name in GRPO_FAMILY, name
    eps = config.get("epsilon", 0.2)
    eps_high = config.get("epsilon_high", eps)
    beta = config.get("beta", 0.0)
    terms = []
    for lp, x, m in zip(lps, ins, masks):
        old = x.get("logprobs", lp.detach())
        log_ratio = torch.clamp(lp - old, -20, 20)
        if name == "twinkle:gspo":  # one weight per sequence: the masked mean log-ratio
            log_ratio = (log_ratio * m).sum() / m.sum().clamp(min=1)
        r = torch.exp(log_ratio)
        a = x["advantages"]
        if name == "twinkle:cispo":
            per_token = -torch.clamp(r, max=1 + eps).detach() * a * lp
        else:
            per_token = -torch.minimum(r * a, torch.clamp(r, 1 - eps, 1 + eps_high) * a)
        if beta > 0 and "ref_logprobs" in x:
            d = x["ref_logprobs"] - lp
            per_token = per_token + beta * (torch.exp(d) - d - 1)
        terms.append(per_token * m)
    num_seqs = context.get("window_sequences") or len(lps)
    num_tokens = context.get("window_tokens") or max(float(sum(m.sum() for m in masks)), 1.0)
    if name in ("twinkle:grpo", "twinkle:gspo"):  # mean over sequences of sequence means
        return [t / (m.sum().clamp(min=1) * num_seqs) for t, m in zip(terms, masks)]
    if name in ("twinkle:cispo", "twinkle:bnpo"):  # all masked tokens / token count
        return [t / num_tokens for t in terms]
    return [t / (num_seqs * config.get("max_completion_length", 1024)) for t in terms]  # dr_grpo


GRPO_FAMILY = ("twinkle:grpo", "twinkle:gspo", "twinkle:cispo", "twinkle:bnpo", "twinkle:dr_grpo")


# ---------------------------------------------------------------- random inputs


def make_datums(case: dict[str, Any], dtype: torch.dtype, seed: int) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(seed)
    spread = case.get("spread", 0.3)
    datums = []
    for i, n in enumerate(case.get("lengths", [1, 5, 17, 0, 64, 3])):
        lp = -3 * torch.rand(n, generator=g, dtype=torch.float64)
        x: dict[str, torch.Tensor] = {}
        for key in case["inputs"]:
            if key == "logprobs":  # sampler / old policy near the current one
                x[key] = lp + spread * torch.randn(n, generator=g, dtype=torch.float64)
            elif key == "logprobs_far":  # beyond GRPO's ±20 clamp on some tokens
                x["logprobs"] = lp + 25 * torch.randn(n, generator=g, dtype=torch.float64)
            elif key == "advantages":
                x[key] = torch.randn(n, generator=g, dtype=torch.float64)
            elif key == "ref_logprobs":
                x[key] = lp + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)
            elif key == "weights":  # arbitrary reals, negative included
                x[key] = torch.randn(n, generator=g, dtype=torch.float64)
            elif key in ("mask", "mask_weights"):  # 0/1
                x["mask" if key == "mask" else "weights"] = (
                    torch.rand(n, generator=g) < 0.7).to(torch.float64)
            elif key == "stability_mask":  # 0/1
                x[key] = (torch.rand(n, generator=g) < 0.7).to(torch.float64)
            elif key == "sequence_ratio_mask":  # 0/1, some datums all zero
                x[key] = (torch.rand(n, generator=g) < (0.7 if i % 4 else 0.0)).to(torch.float64)
            elif key == "clip_low_threshold":  # per token, on every other datum only
                if i % 2 == 0:
                    x[key] = 0.7 + 0.25 * torch.rand(n, generator=g, dtype=torch.float64)
            elif key == "clip_high_threshold":
                if i % 2 == 0:
                    x[key] = 1.05 + 0.25 * torch.rand(n, generator=g, dtype=torch.float64)
            else:
                raise AssertionError(key)
        datums.append({"logprobs": lp.to(dtype), "inputs": {k: v.to(dtype) for k, v in x.items()}})
    return datums


RL = ["logprobs", "advantages"]
GSPO_LENGTHS = [1, 2, 5, 17, 0, 3, 64, 2, 1, 9, 4, 1]
CASES: dict[str, dict[str, Any]] = {
    "ce": {"name": "cross_entropy", "inputs": []},
    "ce_weights": {"name": "cross_entropy", "inputs": ["weights"]},
    "is": {"name": "importance_sampling", "inputs": RL},
    "is_weights": {"name": "importance_sampling", "inputs": RL + ["mask_weights"]},
    "ppo": {"name": "ppo", "inputs": RL},
    "ppo_config_weights": {"name": "ppo", "config": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
                           "inputs": RL + ["weights"]},
    "ppo_per_token": {"name": "ppo", "config": {"clip_high_threshold": 1.15},
                      "inputs": RL + ["clip_low_threshold", "clip_high_threshold"]},
    "cispo": {"name": "cispo", "inputs": RL, "spread": 1.0},  # some ratios above 4
    "cispo_config": {"name": "cispo", "config": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
                     "inputs": RL + ["weights"]},
    "dro": {"name": "dro", "inputs": RL},
    "dro_beta_weights": {"name": "dro", "config": {"beta": 0.3}, "inputs": RL + ["weights"]},
    # Tinker's GSPO: wide thresholds with a wide spread, and its own (paper) defaults with a
    # spread to match, so that sequence ratios fall on both sides of the thresholds.
    "gspo_tinker": {"name": "gspo", "config": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
                    "inputs": RL, "spread": 0.6, "lengths": GSPO_LENGTHS},
    "gspo_tinker_defaults_masked": {"name": "gspo", "inputs": RL + ["sequence_ratio_mask", "weights"],
                                    "spread": 1e-3, "lengths": GSPO_LENGTHS},
    "stable_reinforce": {"name": "stable_reinforce", "inputs": RL, "spread": 1.0},
    "stable_reinforce_kl_mask": {"name": "stable_reinforce", "config": {"kl_coeff": 0.1, "clip_high_threshold": 1.5},
                                 "inputs": RL + ["stability_mask", "weights"], "spread": 1.0},
    "twinkle_ce_mean": {"name": "twinkle:cross_entropy", "inputs": ["mask"]},
    "twinkle_ce_sum": {"name": "twinkle:cross_entropy", "config": {"reduction": "sum"},
                       "inputs": ["mask", "mask_weights"]},
    "twinkle_ce_window": {"name": "twinkle:cross_entropy", "inputs": ["mask"],
                          "context": {"window_tokens": 300, "window_sequences": 0}},
    "grpo": {"name": "twinkle:grpo", "inputs": RL + ["mask"]},
    "grpo_on_policy": {"name": "twinkle:grpo", "inputs": ["advantages", "mask"]},
    "grpo_kl_window": {"name": "twinkle:grpo", "config": {"epsilon": 0.1, "epsilon_high": 0.3, "beta": 0.04},
                       "inputs": RL + ["ref_logprobs", "mask"],
                       "context": {"window_tokens": 0, "window_sequences": 16}},
    "grpo_clamp20": {"name": "twinkle:grpo", "inputs": ["logprobs_far", "advantages"]},
    # GSPO: one ratio per sequence; more sequences and a wider spread so that sequence ratios clip.
    "gspo": {"name": "twinkle:gspo", "inputs": RL + ["mask"], "spread": 0.6, "lengths": GSPO_LENGTHS},
    "gspo_on_policy": {"name": "twinkle:gspo", "inputs": ["advantages", "mask_weights"]},
    "gspo_kl_window": {"name": "twinkle:gspo", "config": {"epsilon": 0.1, "epsilon_high": 0.3, "beta": 0.04},
                       "inputs": RL + ["ref_logprobs", "mask"], "spread": 0.8, "lengths": GSPO_LENGTHS,
                       "context": {"window_tokens": 0, "window_sequences": 16}},
    "gspo_clamp20": {"name": "twinkle:gspo", "inputs": ["logprobs_far", "advantages"]},
    "twinkle_cispo": {"name": "twinkle:cispo", "inputs": RL + ["mask"]},
    "twinkle_cispo_kl_window": {"name": "twinkle:cispo", "config": {"epsilon": 0.5, "beta": 0.04},
                                "inputs": RL + ["ref_logprobs", "mask", "mask_weights"], "spread": 1.0,
                                "context": {"window_tokens": 300, "window_sequences": 0}},
    "bnpo": {"name": "twinkle:bnpo", "inputs": RL + ["mask", "mask_weights"]},
    "bnpo_kl_window": {"name": "twinkle:bnpo", "config": {"epsilon_high": 0.28, "beta": 0.1},
                       "inputs": RL + ["ref_logprobs", "mask"],
                       "context": {"window_tokens": 300, "window_sequences": 0}},
    "dr_grpo": {"name": "twinkle:dr_grpo", "inputs": RL + ["mask"]},
    "dr_grpo_kl_window": {"name": "twinkle:dr_grpo",
                          "config": {"max_completion_length": 64, "epsilon": 0.1, "beta": 0.04},
                          "inputs": RL + ["ref_logprobs", "mask"],
                          "context": {"window_tokens": 0, "window_sequences": 16}},
}


def probe(engine: Engine, case: dict[str, Any], datums: list[dict[str, Any]]) -> dict[str, Any]:
    context = case.get("context", {"window_tokens": 0, "window_sequences": 0})
    return engine.call("loss_probe", {"loss": {"name": case["name"], "config": case.get("config", {})},
                                      "datums": datums, "context": context})


def check(engine: Engine, label: str, case: dict[str, Any], dtype: torch.dtype, tol: float,
          absolute: bool, seed: int) -> None:
    datums = make_datums(case, dtype, seed)
    got = probe(engine, case, datums)
    context = case.get("context", {})
    total, terms, grads = reference(case["name"], case.get("config", {}), datums, context)
    got_total = torch.tensor([got["total"]], dtype=torch.float64)
    largest = [assert_close(f"{label} total", got_total, total.reshape(1), tol, absolute)]
    assert len(got["elementwise"]) == len(got["grad_logprobs"]) == len(datums)
    for i, (e, g) in enumerate(zip(got["elementwise"], got["grad_logprobs"])):
        assert e.dtype == g.dtype == dtype
        largest.append(assert_close(f"{label} datum{i} elementwise", e, terms[i], tol, absolute))
        largest.append(assert_close(f"{label} datum{i} grad", g, grads[i], tol, absolute))
    loss_key = "loss:sum" if "loss:sum" in got["metrics"] else "loss:mean"
    assert got["metrics"][loss_key] == pytest.approx(got["total"], rel=1e-12, abs=1e-300)
    assert got["metrics"]["num_sequences:sum"] == len(datums)
    print(f"{label}: largest difference {max(largest):.3e}")


@pytest.mark.parametrize("case_id", sorted(CASES))
def test_float64_matches_formula(loss_engine: Engine, case_id: str) -> None:
    case = CASES[case_id]
    # The ±20 clamp cases reach ratios of e^20; compare relative to the largest value there.
    check(loss_engine, case_id, case, torch.float64, 1e-10, absolute=not case_id.endswith("clamp20"), seed=7)


@pytest.mark.parametrize("case_id", ["ce_weights", "is", "ppo", "cispo", "dro", "gspo_tinker",
                                     "gspo_tinker_defaults_masked", "stable_reinforce_kl_mask",
                                     "twinkle_ce_mean", "grpo_kl_window",
                                     "gspo", "twinkle_cispo", "bnpo", "dr_grpo_kl_window"])
def test_float32_matches_formula(loss_engine: Engine, case_id: str) -> None:
    check(loss_engine, f"{case_id} fp32", CASES[case_id], torch.float32, 1e-5, absolute=False, seed=11)


def test_ratios_straddle_the_clip_thresholds() -> None:
    # Guards the inputs themselves: a test whose ratios never clip would not test clipping.
    for case_id, lo, hi in [("ppo", 0.8, 1.2), ("cispo", 0.0, 4.0), ("grpo", 0.8, 1.2),
                            ("twinkle_cispo", 0.0, 1.2), ("bnpo", 0.8, 1.2)]:
        r = torch.cat([torch.exp(d["logprobs"] - d["inputs"]["logprobs"])
                       for d in make_datums(CASES[case_id], torch.float64, 7)])
        assert (r > hi).any() and ((r < lo).any() or lo == 0.0) and ((r > lo) & (r < hi)).any(), case_id
    # GSPO clips whole sequences: their masked mean log-ratios must fall on both sides too.
    for case_id, lo, hi in [("gspo", 0.8, 1.2), ("gspo_kl_window", 0.9, 1.3)]:
        r = torch.stack([torch.exp(((d["logprobs"] - d["inputs"]["logprobs"]) * d["inputs"]["mask"]).sum()
                                   / d["inputs"]["mask"].sum().clamp(min=1))
                         for d in make_datums(CASES[case_id], torch.float64, 7)])
        assert (r > hi).any() and (r < lo).any() and ((r > lo) & (r < hi)).any(), (case_id, r)


def test_tinker_gspo_sequence_ratios_straddle_the_thresholds() -> None:
    for case_id, lo, hi in [("gspo_tinker", 0.8, 1.2), ("gspo_tinker_defaults_masked", 1 - 3e-4, 1 + 4e-4)]:
        ratios = []
        for d in make_datums(CASES[case_id], torch.float64, 7):
            m = d["inputs"].get("sequence_ratio_mask", torch.ones_like(d["logprobs"])) != 0
            if bool(m.any()):
                ratios.append(torch.exp((d["logprobs"] - d["inputs"]["logprobs"])[m].mean()))
        r = torch.stack(ratios)
        assert (r > hi).any() and (r < lo).any() and ((r > lo) & (r < hi)).any(), (case_id, r)


def test_stable_reinforce_metrics(loss_engine: Engine) -> None:
    case = CASES["stable_reinforce_kl_mask"]
    datums = make_datums(case, torch.float64, 7)
    got = probe(loss_engine, case, datums)
    kl = truncated = count = 0.0
    for d in datums:
        lp, x = d["logprobs"], d["inputs"]
        counted = (x["weights"] * x["stability_mask"]) != 0
        diff = x["logprobs"] - lp
        kl += float(((torch.exp(diff) - diff - 1) * counted).sum())
        truncated += float(((torch.exp(lp - x["logprobs"]) > 1.5) & counted).sum())
        count += float(counted.sum())
    print(f"kl_sampler:mean {got['metrics']['kl_sampler:mean']:.6f}, truncated {truncated:.0f}/{count:.0f}")
    assert truncated > 0 and truncated < count  # the inputs truncate some weights, not all
    assert got["metrics"]["kl_sampler:mean"] == pytest.approx(kl / count, rel=1e-12)
    assert got["metrics"]["truncated_fraction:mean"] == pytest.approx(truncated / count, rel=1e-12)
    assert got["metrics"]["num_tokens:sum"] == count


def test_new_tinker_loss_config_errors(loss_engine: Engine) -> None:
    rl = {"logprobs": torch.zeros(2, dtype=torch.float64), "advantages": torch.ones(2, dtype=torch.float64)}
    expect_error(loss_engine, {"loss": {"name": "gspo", "config": {"clip_low_threshold": 1.1}},
                               "datums": one_datum(**rl)}, "clip_low_threshold <= 1 <= clip_high_threshold")
    expect_error(loss_engine, {"loss": {"name": "stable_reinforce", "config": {"kl_coeff": -1}},
                               "datums": one_datum(**rl)}, "kl_coeff must be >= 0")
    expect_error(loss_engine, {"loss": {"name": "stable_reinforce", "config": {"kl_coef": 0.1}},
                               "datums": one_datum(**rl)}, "unknown config key 'kl_coef'", "'kl_coeff'")
    expect_error(loss_engine, {"loss": {"name": "stable_reinforce"},
                               "datums": one_datum(**rl, stability_mask=torch.tensor([0.5, 1.0], dtype=torch.float64))},
                 "'stability_mask' must be 0 or 1")


def test_num_tokens_counts_nonzero_weights(loss_engine: Engine) -> None:
    datums = [{"logprobs": torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64),
               "inputs": {"weights": torch.tensor([1.0, 0.0, -0.5], dtype=torch.float64)}}]
    got = probe(loss_engine, {"name": "cross_entropy"}, datums)
    assert got["metrics"]["num_tokens:sum"] == 2
    assert got["metrics"]["loss:sum"] == pytest.approx(1.0 - 1.5)


# ---------------------------------------------------------------- errors


def expect_error(engine: Engine, body: dict[str, Any], *needles: str) -> None:
    with pytest.raises(EngineError) as err:
        engine.call("loss_probe", body)
    print(f"error: {err.value.message}")
    assert err.value.code == INVALID_ARGUMENT, err.value
    for needle in needles:
        assert needle in err.value.message


def one_datum(**inputs: torch.Tensor) -> list[dict[str, Any]]:
    return [{"logprobs": torch.tensor([-1.0, -2.0], dtype=torch.float64), "inputs": inputs}]


def test_unknown_loss_name(loss_engine: Engine) -> None:
    expect_error(loss_engine, {"loss": {"name": "grpo2"}, "datums": one_datum()},
                 "unknown loss 'grpo2'", "'cross_entropy'", "'ppo'", "'gspo'", "'stable_reinforce'", "'twinkle:grpo'", "'twinkle:gspo'",
                 "'twinkle:cispo'", "'twinkle:bnpo'", "'twinkle:dr_grpo'", "'twinkle:dpo'")


def test_unknown_config_key(loss_engine: Engine) -> None:
    expect_error(loss_engine, {"loss": {"name": "ppo", "config": {"clip_ratio": 0.2}}, "datums": one_datum()},
                 "loss 'ppo'", "unknown config key 'clip_ratio'", "'clip_low_threshold', 'clip_high_threshold'")


def test_out_of_range_config(loss_engine: Engine) -> None:
    expect_error(loss_engine, {"loss": {"name": "dro", "config": {"beta": -0.1}}, "datums": one_datum()},
                 "beta must be >= 0")
    expect_error(loss_engine, {"loss": {"name": "cispo", "config": {"clip_low_threshold": 5}},
                               "datums": one_datum()}, "clip_low_threshold <= clip_high_threshold")
    expect_error(loss_engine, {"loss": {"name": "twinkle:cross_entropy", "config": {"reduction": "avg"}},
                               "datums": one_datum()}, "reduction must be 'mean' or 'sum'")


def test_missing_and_malformed_inputs(loss_engine: Engine) -> None:
    good = {"logprobs": torch.zeros(2, dtype=torch.float64), "advantages": torch.ones(2, dtype=torch.float64)}
    datums = one_datum(**good) + one_datum(logprobs=good["logprobs"])
    expect_error(loss_engine, {"loss": {"name": "importance_sampling"}, "datums": datums},
                 "datum 1", "missing required input 'advantages'")
    expect_error(loss_engine, {"loss": {"name": "cross_entropy"},
                               "datums": one_datum(weights=torch.ones(3, dtype=torch.float64))},
                 "datum 0", "'weights' has shape [3], expected [2]")
    expect_error(loss_engine, {"loss": {"name": "cross_entropy"},
                               "datums": one_datum(weights=torch.tensor([1.0, float("nan")], dtype=torch.float64))},
                 "non-finite")
    expect_error(loss_engine, {"loss": {"name": "cross_entropy"}, "datums": one_datum(mask=torch.ones(2))},
                 "unknown input 'mask'")
    expect_error(loss_engine, {"loss": {"name": "cross_entropy"}, "datums": []}, "at least one datum")
    expect_error(loss_engine, {"loss": {"name": "cross_entropy"}, "datums": "nope"}, "malformed loss_probe body")
