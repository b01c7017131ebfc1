"""The engine's penalties and min-p (repetition_penalty, presence_penalty, frequency_penalty,
min_p; core/engine/sampler/sampler.h) against independent references: transformers generate
with repetition_penalty, a PyTorch loop of OpenAI's presence/frequency formula on the
transformers model's logits, and transformers' logits processors (fp32, CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_harness import Engine, EngineError
from test_model import ALL_LINEAR, sequences
from test_sampler_pool import chi_square_p_value, load, make_adapter, row, step
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper)

GAP = 1e-4  # greedy tokens are compared up to the first near-tie of the reference
VOCAB = 256


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    """One intra-op thread for the worker and the references (test_sampler_pool.one_thread)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with Engine() as e:
        yield e
    torch.set_num_threads(threads)


def setup(engine: Engine, model_dir: Path) -> dict[str, torch.nn.Module]:
    load(engine, model_dir)
    refs = {"": AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()}
    refs["a"] = make_adapter(engine, model_dir, "a", 4, ALL_LINEAR, seed=11)
    return refs


def reference_greedy(model: torch.nn.Module, prompt: torch.Tensor, max_tokens: int, repetition: float = 1.0,
                     presence: float = 0.0, frequency: float = 0.0) -> tuple[list[int], list[float]]:
    """Greedy decoding over penalised logits, recomputed from the whole sequence each step:
    transformers' RepetitionPenaltyLogitsProcessor over prompt + generated tokens, then OpenAI's
    formula over the generated tokens, logit - count * frequency - (count > 0) * presence.
    Returns the tokens and each step's top-2 gap of the penalised logits."""
    ids = prompt.unsqueeze(0)
    counts = torch.zeros(1, VOCAB)
    processor = RepetitionPenaltyLogitsProcessor(float(repetition)) if repetition != 1.0 else None
    tokens, gaps = [], []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(input_ids=ids).logits[:, -1].float()
            if processor is not None:
                logits = processor(ids, logits)
            logits = logits - counts * frequency - (counts > 0).float() * presence
            top2 = logits[0].double().topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            token = int(logits[0].argmax())
            tokens.append(token)
            counts[0, token] += 1
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return tokens, gaps


def compare(got: list[int], ref: list[int], gaps: list[float], what: Any) -> bool:
    """Tokens agree up to the reference's first near-tie (that position may go either way).
    Returns whether every token was compared."""
    for t, (a, b) in enumerate(zip(got, ref)):
        if gaps[t] < GAP:
            return False
        assert a == b, f"{what}: token {t} differs: engine {got}, reference {ref} (gap {gaps[t]:.3e})"
    assert len(got) == len(ref), (what, got, ref)
    return True


@pytest.mark.parametrize("variant", ["qwen3", "llama-llama3-rope"])
def test_greedy_repetition_penalty_matches_transformers_generate(engine: Engine, reference_models: Path,
                                                                 variant: str) -> None:
    """Greedy rows with repetition_penalty (> 1 and < 1) against transformers
    generate(do_sample=False, repetition_penalty=...), token for token up to a near-tie."""
    model_dir = reference_models / variant
    refs = setup(engine, model_dir)
    prompts = sequences(VOCAB, [6, 1, 13, 9], seed=51)
    max_tokens = 16
    cases = [(a, p, penalty) for penalty in (1.5, 0.7) for a, p in zip(["a", "", "a", ""], prompts)]
    rows = [row(a, p, max_tokens=max_tokens, repetition_penalty=penalty, num_samples=2) for a, p, penalty in cases]
    reply = engine.call("sample", {"rows": rows})
    plain = engine.call("sample", {"rows": [row(a, p, max_tokens=max_tokens) for a, p, _ in cases]})
    full = changed = 0
    for i, (a, p, penalty) in enumerate(cases):
        with torch.no_grad():
            out = refs[a].generate(p.unsqueeze(0), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                   do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                   eos_token_id=None, pad_token_id=0, repetition_penalty=penalty,
                                   output_scores=True, return_dict_in_generate=True)
        ref = out.sequences[0, len(p):].tolist()
        gaps = [float(s[0].double().topk(2).values[0] - s[0].double().topk(2).values[1]) for s in out.scores]
        for s, got in enumerate(reply["rows"][i]["samples"]):
            full += compare(got["tokens"].tolist(), ref, gaps, (i, a, penalty, s))
        changed += reply["rows"][i]["samples"][0]["tokens"].tolist() != plain["rows"][i]["samples"][0]["tokens"].tolist()
        # The reported logprobs stay the unpenalised model's.
        seq = torch.cat([p, reply["rows"][i]["samples"][0]["tokens"]])
        with torch.no_grad():
            lp = torch.log_softmax(refs[a](input_ids=seq.unsqueeze(0)).logits[0, len(p) - 1:-1].float(), -1)
        want = lp.gather(1, seq[len(p):].unsqueeze(1)).squeeze(1)
        assert torch.allclose(reply["rows"][i]["samples"][0]["logprobs"], want, atol=1e-4), (i, a, penalty)
    print(f"{variant}: {full}/{2 * len(cases)} samples compared over all {max_tokens} tokens; "
          f"{changed}/{len(cases)} rows changed by the penalty")
    assert full >= len(cases)  # most rows have no near-tie
    assert changed >= len(cases) // 2  # the penalty is not a no-op


@pytest.mark.parametrize("repetition,presence,frequency", [(1.0, 1.5, 0.0), (1.0, 0.0, 2.0), (1.0, -1.0, 0.5),
                                                          (1.3, 0.5, 0.5), (1.0, -2.0, -2.0)])
def test_greedy_presence_frequency_match_openai_formula(engine: Engine, reference_models: Path, repetition: float,
                                                        presence: float, frequency: float) -> None:
    """Greedy rows with presence / frequency penalties (and repetition_penalty with them)
    against a PyTorch loop of OpenAI's formula on the transformers model's logits; two samples
    per row, each with its own counts."""
    model_dir = reference_models / "qwen3"
    refs = setup(engine, model_dir)
    prompts = sequences(VOCAB, [7, 2, 11], seed=61)
    adapters = ["a", "", "a"]
    max_tokens = 16
    params = {"repetition_penalty": repetition, "presence_penalty": presence, "frequency_penalty": frequency}
    reply = engine.call("sample", {"rows": [row(a, p, max_tokens=max_tokens, num_samples=2, **params)
                                            for a, p in zip(adapters, prompts)]})
    plain = engine.call("sample", {"rows": [row(a, p, max_tokens=max_tokens) for a, p in zip(adapters, prompts)]})
    full = changed = 0
    for i, (a, p) in enumerate(zip(adapters, prompts)):
        ref, gaps = reference_greedy(refs[a], p, max_tokens, repetition, presence, frequency)
        for s, got in enumerate(reply["rows"][i]["samples"]):
            full += compare(got["tokens"].tolist(), ref, gaps, (i, a, s))
        changed += reply["rows"][i]["samples"][0]["tokens"].tolist() != plain["rows"][i]["samples"][0]["tokens"].tolist()
    print(f"{params}: {full}/{2 * len(prompts)} samples compared over all {max_tokens} tokens, "
          f"{changed}/{len(prompts)} rows changed")
    assert full >= len(prompts)
    assert changed >= 1


def test_each_sample_keeps_its_own_counts_while_sampling(engine: Engine, reference_models: Path) -> None:
    """Sampling (temperature 1) with min_p = 1 keeps only the most likely token, so every one
    of 4 samples, each drawing from its own generator, must follow the penalised greedy
    reference; counts shared between samples (or with another row) would make them diverge."""
    model_dir = reference_models / "qwen3"
    refs = setup(engine, model_dir)
    prompts = sequences(VOCAB, [5, 9], seed=71)
    max_tokens = 20
    params = {"repetition_penalty": 1.2, "presence_penalty": 0.5, "frequency_penalty": 1.0, "min_p": 1.0,
              "temperature": 1.0, "num_samples": 4}
    reply = engine.call("sample", {"rows": [row("a", p, max_tokens=max_tokens, seed=3 + i, **params)
                                            for i, p in enumerate(prompts)]})
    # The same through the continuous batch (sample_step), joined one after the other.
    results: dict[int, Any] = {}
    r = step(engine, [(0, row("a", prompts[0], max_tokens=max_tokens, seed=3, **params))], steps=3)
    r = step(engine, [(1, row("a", prompts[1], max_tokens=max_tokens, seed=4, **params))], steps=4)
    while True:
        for f in r["finished"]:
            results[f["request_id"]] = f["result"]
        if not r["running"]:
            break
        r = step(engine, steps=8)
    for i, p in enumerate(prompts):
        ref, gaps = reference_greedy(refs["a"], p, max_tokens, 1.2, 0.5, 1.0)
        for s in range(4):
            compare(reply["rows"][i]["samples"][s]["tokens"].tolist(), ref, gaps, ("sample", i, s))
            compare(results[i]["samples"][s]["tokens"].tolist(), ref, gaps, ("sample_step", i, s))


@pytest.mark.parametrize("temperature,top_k,min_p,repetition", [(0.1, 0, 0.2, 1.0), (0.1, 0, 0.2, 1.5),
                                                                (0.1, 0, 0.2, 0.6), (0.05, 12, 0.1, 1.0),
                                                                (0.05, 8, 0.2, 1.5)])
def test_min_p_draws_match_transformers_warpers(engine: Engine, reference_models: Path, temperature: float,
                                                top_k: int, min_p: float, repetition: float) -> None:
    """20 000 first tokens of one prompt against transformers' processors in generate's order
    (RepetitionPenalty, Temperature, TopK, MinP) on the reference logits: every draw inside
    the allowed set, the drawn set equal to it, and a chi-square test at p >= 1e-3. (The tiny
    model's logits are flat, hence the low temperatures; with this prompt the penalty changes
    the allowed set: 15 tokens at 1.0, 12 at 1.5, 4 at 0.6.)"""
    model_dir = reference_models / "qwen3"
    refs = setup(engine, model_dir)
    prompt = sequences(VOCAB, [24], seed=1)[0]
    draws, per_row = 20000, 2000
    rows = [row("", prompt, max_tokens=1, temperature=temperature, top_k=top_k, min_p=min_p,
                repetition_penalty=repetition, seed=2000 + r, num_samples=per_row) for r in range(draws // per_row)]
    reply = engine.call("sample", {"rows": rows})
    tokens = torch.tensor([int(s["tokens"][0]) for r in reply["rows"] for s in r["samples"]])
    assert len(tokens) == draws
    ids = prompt.unsqueeze(0)
    with torch.no_grad():
        scores = refs[""](input_ids=ids).logits[:, -1].float()
    if repetition != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(repetition)(ids, scores)
    scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    scores = MinPLogitsWarper(min_p)(ids, scores)
    probs = torch.softmax(scores[0].double(), -1)
    allowed = set(torch.nonzero(probs > 0).flatten().tolist())
    observed = torch.bincount(tokens, minlength=VOCAB).double()
    assert set(tokens.tolist()) <= allowed, f"{sorted(set(tokens.tolist()) - allowed)} drawn outside min_p's set"
    assert set(tokens.tolist()) == allowed, f"{sorted(allowed - set(tokens.tolist()))} allowed, never drawn"
    assert 1 < len(allowed) < (top_k or VOCAB)  # min_p did cut, and left a choice
    stat, df, p = chi_square_p_value(observed, probs * draws)
    print(f"T={temperature} top_k={top_k} min_p={min_p} rep={repetition}: allowed {len(allowed)}, "
          f"chi2 {stat:.1f} on {df} df, p = {p:.3g}")
    assert p >= 1e-3


def test_penalty_limits_at_limit_plus_one(engine: Engine, reference_models: Path) -> None:
    """Each range accepted at its limit and refused just past it, naming the field, in the
    one-shot call and in sample_step's rejections."""
    load(engine, reference_models / "qwen3")
    p = torch.tensor([1, 2, 3])
    for params in ({"presence_penalty": 2.0, "frequency_penalty": -2.0}, {"presence_penalty": -2.0},
                   {"frequency_penalty": 2.0}, {"min_p": 1.0}, {"min_p": 0.0}, {"repetition_penalty": 1e-6},
                   {"repetition_penalty": 100.0}):
        assert len(engine.call("sample", {"rows": [row("", p, max_tokens=2, **params)]})["rows"]) == 1, params
    bad = {
        1: ({"presence_penalty": 2.001}, "presence_penalty (2.001) must be in [-2, 2]"),
        2: ({"presence_penalty": -2.001}, "presence_penalty (-2.001) must be in [-2, 2]"),
        3: ({"frequency_penalty": 2.001}, "frequency_penalty (2.001) must be in [-2, 2]"),
        4: ({"frequency_penalty": float("nan")}, "frequency_penalty (nan) must be in [-2, 2]"),
        5: ({"min_p": 1.001}, "min_p (1.001) must be in [0, 1]"),
        6: ({"min_p": -0.001}, "min_p (-0.001) must be in [0, 1]"),
        7: ({"repetition_penalty": 0.0}, "repetition_penalty (0) must be finite and > 0"),
        8: ({"repetition_penalty": -1.0}, "repetition_penalty (-1) must be finite and > 0"),
        9: ({"repetition_penalty": float("inf")}, "repetition_penalty (inf) must be finite and > 0"),
    }
    for i, (params, message) in bad.items():
        with pytest.raises(EngineError) as e:
            engine.call("sample", {"rows": [row("", p, **params)]})
        assert e.value.code == 3 and e.value.message == f"row 0: {message}", e.value.message
    reply = step(engine, [(i, row("", p, **params)) for i, (params, _) in bad.items()], steps=0)
    assert {r["request_id"]: r["error"] for r in reply["rejected"]} == {i: m for i, (_, m) in bad.items()}
    assert reply["running"] == 0
