"""The engine's generation pool: paged KV cache and continuous batching (`sample_step`), and
one-shot `sample` on top of it, against transformers generate with PEFT-merged adapters, the
engine's own training forward pass and transformers' logits warpers (fp32, CPU)."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_harness import Engine, EngineError
from numerics import assert_close
from sampling_checks import assert_greedy_matches_generate, assert_samples_match_training_forward
from test_model import ALL_LINEAR, peft_model, random_lora_state, sequences
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

GAP = 1e-4  # greedy tokens are compared up to the first near-tie of the reference
ARCHITECTURES = ["llama-llama3-rope", "qwen2", "qwen3"]

# Four adapters of different ranks and targets (d also on lm_head).
ADAPTERS = {
    "a": (4, ALL_LINEAR),
    "b": (8, ALL_LINEAR),
    "c": (2, ["q_proj", "v_proj", "down_proj"]),
    "d": (6, ["k_proj", "o_proj", "gate_proj", "up_proj", "lm_head"]),
}


@pytest.fixture(autouse=True)
def one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The workers these tests start run one intra-op thread (they inherit the variable), and
    so do the transformers references: MKL splits even the tiny models' GEMMs across
    threads, and on a shared, loaded machine each such split waits for a thread that is not
    running (10-20x slower here). A row's numbers do not depend on the thread count."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def engine(one_thread: None) -> Iterator[Engine]:
    with Engine() as e:
        yield e


def load(engine: Engine, model_dir: Path, **kw: Any) -> dict[str, Any]:
    body = {"model_dir": str(model_dir), "dtype": "float32", "device": "cpu"}
    body.update(kw)
    return engine.call("load_model", body)


def make_adapter(engine: Engine, model_dir: Path | None, adapter_id: str, rank: int, targets: list[str],
                 seed: int) -> torch.nn.Module | None:
    """Creates the adapter with random non-zero weights; returns the PEFT reference (merged,
    except with an lm_head target)."""
    engine.call("create_adapter", {"adapter_id": adapter_id, "rank": rank, "alpha": 2.0 * rank,
                                   "seed": seed, "targets": targets})
    weights = random_lora_state(engine, adapter_id, seed=seed + 100)
    engine.call("set_adapter_state", {"adapter_id": adapter_id, "weights": weights})
    if model_dir is None:
        return None
    model = peft_model(model_dir, rank, 2.0 * rank, weights, targets).eval()
    # Merging an lm_head LoRA into tied embeddings would change the input embedding too
    # (one shared tensor); PEFT itself, unmerged, applies it to the logits only.
    return model if "lm_head" in targets else model.merge_and_unload().eval()


def setup_adapters(engine: Engine, model_dir: Path, references: bool = True) -> dict[str, Any]:
    refs: dict[str, Any] = {}
    if references:
        refs[""] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for i, (name, (rank, targets)) in enumerate(ADAPTERS.items()):
        refs[name] = make_adapter(engine, model_dir if references else None, name, rank, targets, seed=11 + i)
    return refs


def row(adapter: str, prompt: torch.Tensor, **kw: Any) -> dict[str, Any]:
    r = {"adapter_id": adapter, "prompt_tokens": prompt, "max_tokens": 12, "temperature": 0.0}
    r.update(kw)
    return r


def sampled_rows(n: int, seed: int, adapters: list[str]) -> list[dict[str, Any]]:
    """n rows with varied sampling parameters, prompt lengths and adapters."""
    rng = random.Random(seed)
    prompts = sequences(256, [rng.randint(1, 40) for _ in range(n)], seed=seed)
    rows = []
    for i, p in enumerate(prompts):
        rows.append(row(adapters[i % len(adapters)], p, max_tokens=rng.randint(1, 16),
                        temperature=rng.choice([0.0, 0.05, 0.7, 1.0, 1.3]), top_k=rng.choice([0, 5, 40]),
                        top_p=rng.choice([1.0, 0.9, 0.5]), seed=rng.randrange(1 << 32),
                        num_samples=rng.randint(1, 3)))
    return rows


def tokens_of(result: dict[str, Any]) -> list[list[int]]:
    return [s["tokens"].tolist() for s in result["samples"]]


def step(engine: Engine, admit: list[tuple[int, dict[str, Any]]] | None = None, cancel: list[int] | None = None,
         steps: int = 8, reset: bool = False, stop: list[tuple[int, int]] | None = None) -> dict[str, Any]:
    return engine.call("sample_step", {"admit": [{"request_id": i, "row": r} for i, r in admit or []],
                                       "cancel": cancel or [], "max_decode_steps": steps, "reset": reset,
                                       "stop": [{"request_id": i, "sample": s} for i, s in stop or []]})


def drain(engine: Engine, reply: dict[str, Any], results: dict[int, Any], steps: int = 8) -> dict[str, Any]:
    for f in reply["finished"]:
        results[f["request_id"]] = f["result"]
    while reply["running"]:
        reply = step(engine, steps=steps)
        for f in reply["finished"]:
            results[f["request_id"]] = f["result"]
    return reply


def first_difference(x: list[int], y: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y)))


@pytest.mark.parametrize("variant", ARCHITECTURES)
def test_greedy_16_prompts_x_4_adapters_match_transformers_generate(engine: Engine, reference_models: Path,
                                                                    variant: str) -> None:
    """64 greedy sequences (16 prompts x 4 adapters) decoding in one batch, each against
    transformers generate on the PEFT-merged model, compared up to the first position where
    the reference's top-2 logit gap is below GAP."""
    model_dir = reference_models / variant
    load(engine, model_dir)
    refs = setup_adapters(engine, model_dir)
    prompts = sequences(256, [1 + (7 * i) % 29 for i in range(16)], seed=21)
    cases = [(a, p) for p in prompts for a in ADAPTERS]
    assert_greedy_matches_generate(engine, refs, cases, max_tokens=16, gap=GAP, label=variant)


@pytest.mark.parametrize("block_size", [16, 3])
def test_logprobs_match_training_forward(engine: Engine, reference_models: Path, block_size: int) -> None:
    """Sampled-token and prompt logprobs, through sample_step, equal the training forward pass
    over prompt + generated tokens (small blocks: prompts and samples span several blocks and
    the samples share the prompt's full blocks)."""
    model_dir = reference_models / "qwen3"
    load(engine, model_dir, kv_block_size=block_size)
    setup_adapters(engine, model_dir, references=False)
    prompts = sequences(256, [6, 13, 2, 20, 31], seed=31)
    adapters = ["a", "d", "", "c", "b"]
    rows = [row(a, p, temperature=1.0, top_k=40, top_p=0.9, seed=7 + i, num_samples=3, max_tokens=10,
                want_prompt_logprobs=True) for i, (a, p) in enumerate(zip(adapters, prompts))]
    results: dict[int, Any] = {}
    drain(engine, step(engine, list(enumerate(rows)), steps=3), results)
    for i, p in enumerate(prompts):
        result = results[i]
        assert len(result["samples"]) == 3 and result["prompt_logprobs"].shape == (len(p) - 1,)
    worst = assert_samples_match_training_forward(engine, results, adapters, prompts, max_tokens=10)
    print(f"block size {block_size}: largest logprob difference {worst:.3e}")


def chi_square_p_value(observed: torch.Tensor, expected: torch.Tensor) -> tuple[float, int, float]:
    """Pearson's statistic over bins with expected count >= 5 (the others pooled into one bin);
    p = Q(df/2, stat/2), the chi-square survival function, by torch.special.gammaincc."""
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if float(exp[-1]) < 5:  # nothing (or too little) to pool: fold it into the smallest bin
        assert float(obs[-1]) <= float(exp[-1]) + 5
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    p = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return stat, df, p


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.05, 0, 1.0), (0.08, 12, 1.0), (0.1, 0, 0.6),
                                                     (0.06, 20, 0.9), (1.0, 0, 0.1)])
def test_sampling_matches_the_warped_distribution(engine: Engine, reference_models: Path, temperature: float,
                                                  top_k: int, top_p: float) -> None:
    """20 000 first tokens of one prompt (samples of a few rows, each its own generator),
    against transformers' temperature/top-k/top-p warpers on the reference logits: never a
    token outside the warped support, and a chi-square test at p >= 1e-3 (fixed seeds)."""
    model_dir = reference_models / "qwen3"
    load(engine, model_dir)
    ref = make_adapter(engine, model_dir, "a", 4, ALL_LINEAR, seed=5)
    prompt = sequences(256, [16], seed=9)[0]
    draws, per_row = 20000, 2000
    rows = [row("a", prompt, max_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p, seed=1000 + r,
                num_samples=per_row) for r in range(draws // per_row)]
    reply = engine.call("sample", {"rows": rows})
    tokens = torch.tensor([int(s["tokens"][0]) for r in reply["rows"] for s in r["samples"]])
    assert len(tokens) == draws
    with torch.no_grad():
        logits = ref(input_ids=prompt.unsqueeze(0)).logits[:, -1]
    warped = TemperatureLogitsWarper(temperature)(prompt.unsqueeze(0), logits)
    if top_k > 0:
        warped = TopKLogitsWarper(top_k)(prompt.unsqueeze(0), warped)
    if top_p < 1.0:
        warped = TopPLogitsWarper(top_p)(prompt.unsqueeze(0), warped)
    probs = torch.softmax(warped[0].double(), -1)
    observed = torch.bincount(tokens, minlength=256).double()
    outside = int(observed[probs == 0].sum())
    assert outside == 0, f"{outside} draws outside the warped support"
    stat, df, p = chi_square_p_value(observed, probs * draws)
    support = int((probs > 0).sum())
    print(f"T={temperature} top_k={top_k} top_p={top_p}: support {support}, chi2 {stat:.1f} on {df} df, p = {p:.3g}")
    assert p >= 1e-3


def test_same_seed_same_batch_and_alone_vs_batch_of_16(engine: Engine, reference_models: Path) -> None:
    """The same batch twice gives identical tokens; each of 16 rows alone gives the tokens it
    gets inside the batch (>= 99% of sequences; any that differ are printed)."""
    total = same = 0
    for v, variant in enumerate(ARCHITECTURES):
        with Engine() as e:
            model_dir = reference_models / variant
            load(e, model_dir)
            setup_adapters(e, model_dir, references=False)
            rows = sampled_rows(16, seed=v, adapters=["", "a", "b", "c", "d"])
            first = e.call("sample", {"rows": rows})
            again = e.call("sample", {"rows": rows})
            for i in range(len(rows)):
                assert tokens_of(first["rows"][i]) == tokens_of(again["rows"][i]), (variant, i)
            for i, r in enumerate(rows):
                alone = e.call("sample", {"rows": [r]})["rows"][0]
                for s, (x, y) in enumerate(zip(alone["samples"], first["rows"][i]["samples"])):
                    total += 1
                    if x["tokens"].tolist() == y["tokens"].tolist():
                        same += 1
                        assert_close(f"{variant} row{i} sample{s} alone vs batch logprobs", x["logprobs"],
                                     y["logprobs"], 1e-5, absolute=True)
                    else:
                        t = first_difference(x["tokens"].tolist(), y["tokens"].tolist())
                        print(f"DIFFERS {variant} row {i} sample {s} at token {t}: alone {x['tokens'].tolist()} "
                              f"batch {y['tokens'].tolist()}, logprobs there {float(x['logprobs'][t]):.6f} vs "
                              f"{float(y['logprobs'][t]):.6f}")
    print(f"alone vs batch of 16: {same}/{total} sequences identical")
    assert same >= 0.99 * total


@pytest.mark.parametrize("block_size", [16, 3])
def test_joining_a_running_batch_gives_the_tokens_of_alone(engine: Engine, reference_models: Path,
                                                           block_size: int) -> None:
    """Requests admitted at different steps of a running batch (and cancelled neighbours)
    produce exactly what one-shot sample gives each of them alone."""
    model_dir = reference_models / "llama-llama3-rope"
    load(engine, model_dir, kv_block_size=block_size)
    setup_adapters(engine, model_dir, references=False)
    rows = sampled_rows(12, seed=77, adapters=["a", "", "b", "d", "c"])
    for r in rows:
        r["max_tokens"] = 16
    alone = [engine.call("sample", {"rows": [r]})["rows"][0] for r in rows]

    results: dict[int, Any] = {}
    schedule = {0: [0, 1], 1: [2], 3: [3, 4, 5], 4: [], 6: [6], 9: [7, 8], 10: [9], 14: [10, 11]}
    reply: dict[str, Any] = {"running": 0, "finished": []}
    for call in range(16):
        admit = [(i, rows[i]) for i in schedule.get(call, [])]
        # A short-lived neighbour that is cancelled mid-way, and one never seen before.
        if call == 2:
            admit.append((100, row("b", sequences(256, [9], seed=3)[0], max_tokens=16, temperature=1.0)))
        reply = step(engine, admit, cancel=[100, 12345] if call == 5 else [], steps=1 + call % 2)
        assert not reply["rejected"] and not reply["deferred"]
        for f in reply["finished"]:
            results[f["request_id"]] = f["result"]
    drain(engine, reply, results)
    assert 100 not in results
    for i in range(len(rows)):
        assert tokens_of(results[i]) == tokens_of(alone[i]), i
        for x, y in zip(results[i]["samples"], alone[i]["samples"]):
            assert_close(f"request {i} logprobs", x["logprobs"], y["logprobs"], 1e-5, absolute=True)
    assert step(engine, steps=0)["blocks_in_use"] == 0


def test_1000_mixed_requests_leave_no_blocks_behind(engine: Engine, reference_models: Path) -> None:
    """Varied prompt lengths, max_tokens, num_samples, stop tokens, cancels and deferrals
    through a small cache: every result is well formed, blocks never exceed the cache, and
    blocks_in_use is 0 whenever nothing runs and at the end."""
    model_dir = reference_models / "qwen3"
    info = load(engine, model_dir, kv_cache_blocks=96, kv_block_size=4)
    assert info["kv_cache_blocks"] == 96 and info["kv_block_size"] == 4
    setup_adapters(engine, model_dir, references=False)
    rng = random.Random(1)
    rows: dict[int, dict[str, Any]] = {}
    for i in range(1000):
        p = sequences(256, [rng.randint(1, 40)], seed=i)[0]
        rows[i] = row(rng.choice(["", "a", "b", "c", "d"]), p, max_tokens=rng.randint(0, 24),
                      temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.choice([0, 20]),
                      top_p=rng.choice([1.0, 0.8]), seed=i, num_samples=rng.randint(1, 4),
                      stop_token_ids=rng.sample(range(256), rng.choice([0, 5, 20])))
    queue = list(rows)  # not yet admitted, in order (deferred ones go back to the front)
    running: set[int] = set()
    results: dict[int, Any] = {}
    cancelled: set[int] = set()
    calls = deferrals = 0
    while queue or running:
        calls += 1
        admit = queue[:rng.randint(0, 12)]
        cancel_running = [i for i in sorted(running) if rng.random() < 0.03]
        # Plus, now and then, an id that is not running (ignored; it is admitted later).
        cancel = cancel_running + ([queue[-1]] if queue and rng.random() < 0.1 else [])
        reply = step(engine, [(i, rows[i]) for i in admit], cancel=cancel, steps=rng.randint(0, 6))
        assert not reply["rejected"], reply["rejected"]
        assert 0 <= reply["blocks_in_use"] <= reply["blocks_total"] == 96
        running -= set(cancel_running)
        cancelled |= set(cancel_running)
        deferred = reply["deferred"]
        deferrals += len(deferred)
        # FIFO: what was deferred is a suffix of what was offered.
        assert deferred == admit[len(admit) - len(deferred):]
        queue = deferred + queue[len(admit):]
        running |= set(admit) - set(deferred)
        for f in reply["finished"]:
            i = f["request_id"]
            assert i in running
            running.discard(i)
            results[i] = f["result"]
        assert reply["running"] == len(running)
        if not running:
            assert reply["blocks_in_use"] == 0
    final = step(engine, steps=0)
    assert final["blocks_in_use"] == 0 and final["running"] == 0
    assert set(results) | cancelled == set(rows)
    for i, result in results.items():
        r = rows[i]
        assert len(result["samples"]) == r["num_samples"]
        for s in result["samples"]:
            t = s["tokens"].tolist()
            assert len(t) == len(s["logprobs"]) <= r["max_tokens"]
            assert not set(t[:-1]) & set(r["stop_token_ids"])
            if s["stop_reason"] == "stop":
                assert t[-1] in r["stop_token_ids"]
            else:
                assert s["stop_reason"] == "length" and len(t) == r["max_tokens"]
    stops = sum(s["stop_reason"] == "stop" for res in results.values() for s in res["samples"])
    print(f"{calls} calls, {len(results)} finished, {len(rows) - len(results)} cancelled, {deferrals} deferrals, "
          f"{stops} samples ended by a stop token")
    assert deferrals > 0 and stops > 0
    # A few of them against one-shot sample alone.
    for i in sorted(results)[:: 97]:
        assert tokens_of(engine.call("sample", {"rows": [rows[i]]})["rows"][0]) == tokens_of(results[i]), i


def test_rejections_are_clear_and_leave_the_engine_working(engine: Engine, reference_models: Path) -> None:
    model_dir = reference_models / "qwen3"
    info = load(engine, model_dir, kv_cache_blocks=32)
    assert info["kv_cache_blocks"] == 32 and info["kv_block_size"] == 16 and info["max_position_embeddings"] == 256
    setup_adapters(engine, model_dir, references=False)
    p = torch.arange(1, 41)
    good = row("a", p, max_tokens=8)
    bad = {
        1: (row("", p, max_tokens=100, num_samples=8), "prompt (40 tokens) + max_tokens (100) x num_samples (8) "
                                                       "needs 58 KV blocks of 16 tokens, the cache has only 32"),
        2: (row("", p, max_tokens=217), "prompt + max_tokens = 257 (40 + 217) exceeds max_position_embeddings 256"),
        3: (row("nope", p), "no adapter 'nope'"),
        4: (row("", torch.tensor([3, 256])), "prompt token 256 at position 1 is outside [0, 256)"),
        5: (row("", p, top_p=0.0), "top_p must be in (0, 1]"),
        6: (row("", p, temperature=-1.0), "temperature must be finite and >= 0"),
        7: (row("", p, num_samples=0), "num_samples must be >= 1"),
        8: (row("", p, max_tokens=-1), "max_tokens must be >= 0"),
        9: (row("", torch.tensor([], dtype=torch.long)), "prompt_tokens must be a non-empty int64 [P]"),
    }
    reply = step(engine, [(0, good)] + [(i, r) for i, (r, _) in bad.items()] + [(0, good)], steps=0)
    errors = {r["request_id"]: r["error"] for r in reply["rejected"]}
    assert errors.pop(0) == "request_id 0 is already running"
    assert errors == {i: e for i, (_, e) in bad.items()}, errors
    assert reply["running"] == 1 and not reply["deferred"]
    # One-shot sample: the same problems fail the call with the row named.
    for i, (r, message) in bad.items():
        with pytest.raises(EngineError) as e:
            engine.call("sample", {"rows": [good, r]})
        assert f"row 1: {message}" in e.value.message
        assert e.value.code == (5 if i == 3 else 3)  # NOT_FOUND / INVALID_ARGUMENT
    with pytest.raises(EngineError, match="max_decode_steps"):
        engine.call("sample_step", {"max_decode_steps": -1})
    # Still working: the running request finishes as it would alone.
    results: dict[int, Any] = {}
    drain(engine, step(engine), results)
    assert tokens_of(results[0]) == tokens_of(engine.call("sample", {"rows": [good]})["rows"][0])
    assert step(engine, steps=0)["blocks_in_use"] == 0
    # A one-shot row that fits the cache but not beside running sample_step requests.
    big = row("", p, max_tokens=200, num_samples=2)  # 2 + 2 x 13 = 28 blocks
    step(engine, [(1, row("", p, max_tokens=8, num_samples=3))], steps=0)  # 2 + 3 = 5 blocks
    with pytest.raises(EngineError, match="needs 28 KV blocks, 27 of 32 are free") as e:
        engine.call("sample", {"rows": [big]})
    assert e.value.code == 8  # RESOURCE_EXHAUSTED
    drain(engine, step(engine), results)
    assert len(engine.call("sample", {"rows": [big]})["rows"][0]["samples"]) == 2


def test_fifo_deferral_reset_cancel_and_stats(engine: Engine, reference_models: Path) -> None:
    model_dir = reference_models / "qwen2"
    load(engine, model_dir, kv_cache_blocks=19, kv_block_size=8)
    stats = step(engine, steps=0)
    assert stats == {"finished": [], "rejected": [], "deferred": [], "progress": [], "running": 0,
                     "blocks_in_use": 0, "blocks_total": 19, "block_size": 8,
                     "states_in_use": 0, "states_total": 0}
    p = torch.arange(5, 21)  # 16 tokens = 2 full blocks, shared by the samples
    big = row("", p, max_tokens=40, num_samples=3)   # 2 + 3 x 5 = 17 blocks
    small = row("", p, max_tokens=8)                 # 2 + 1 = 3 blocks
    medium = row("", p, max_tokens=16)               # 2 + 2 = 4 blocks
    reply = step(engine, [(1, small), (2, big), (3, small)], steps=0)
    # 2 does not fit beside 1; 3 would, but does not overtake 2.
    assert reply["deferred"] == [2, 3] and reply["running"] == 1 and reply["blocks_in_use"] == 3
    # Cancelling 1 (999 is unknown: ignored) frees its blocks before admission.
    reply = step(engine, [(2, big), (3, small)], cancel=[1, 999], steps=2)
    assert reply["deferred"] == [3] and reply["running"] == 1 and reply["blocks_in_use"] == 17
    # Reset drops everything.
    reply = step(engine, reset=True, steps=0)
    assert reply["running"] == 0 and reply["blocks_in_use"] == 0 and not reply["finished"]
    # A request that finishes (8 tokens: one from the prefill, 7 decode steps) frees its
    # blocks at once, beside one that goes on.
    reply = step(engine, [(3, small), (4, medium)], steps=0)
    assert reply["running"] == 2 and reply["blocks_in_use"] == 7
    reply = step(engine, steps=7)
    assert [f["request_id"] for f in reply["finished"]] == [3] and reply["blocks_in_use"] == 4
    assert len(reply["finished"][0]["result"]["samples"][0]["tokens"]) == 8
    reply = step(engine, steps=8)
    assert [f["request_id"] for f in reply["finished"]] == [4] and reply["blocks_in_use"] == 0
    # max_tokens 0: done at admission (prompt logprobs only).
    reply = step(engine, [(5, row("", p, max_tokens=0, want_prompt_logprobs=True))], steps=0)
    assert reply["finished"][0]["result"]["samples"][0]["tokens"].numel() == 0
    assert reply["finished"][0]["result"]["prompt_logprobs"].shape == (15,) and reply["blocks_in_use"] == 0


def test_reported_tokens_and_early_stop_of_one_sample(engine: Engine, reference_models: Path) -> None:
    """report_tokens rows report each call's new tokens per sample; stopping one sample (what
    the coordinator does when a stop string matches) ends it as "stop" with the tokens it has
    and frees its blocks, while its sibling decodes on to the tokens it makes alone."""
    load(engine, reference_models / "qwen3", kv_cache_blocks=64, kv_block_size=4)
    p = torch.arange(3, 13)  # 10 tokens: 2 shared full blocks
    sampled = row("", p, max_tokens=20, temperature=1.0, seed=5, num_samples=2)
    reference: dict[int, Any] = {}
    drain(engine, step(engine, [(1, sampled)], steps=20), reference)
    full = tokens_of(reference[1])
    assert all(len(t) == 20 for t in full)

    watched = {**sampled, "report_tokens": True}
    reply = step(engine, [(2, watched), (3, sampled)], steps=3)  # prefill token + 3 decode steps
    seen = {(m["request_id"], m["sample"]): list(m["tokens"]) for m in reply["progress"]}
    assert seen == {(2, 0): full[0][:4], (2, 1): full[1][:4]}  # nothing for the unwatched row
    # With their log-probs (what a streamed OpenAI chunk carries), as the finished result has them.
    seen_logprobs = {(m["request_id"], m["sample"]): [float(v) for v in m["logprobs"]] for m in reply["progress"]}
    in_use = reply["blocks_in_use"]
    reply = step(engine, steps=2, stop=[(2, 0), (99, 0), (2, 7)])  # unknown ones are ignored
    assert [(m["request_id"], m["sample"], list(m["tokens"])) for m in reply["progress"]] == [(2, 1, full[1][4:6])]
    # Sample 0's own blocks (beyond the 2 shared ones) went back: ceil(30/4) - 2 = 6.
    assert reply["blocks_in_use"] == in_use - 6
    results: dict[int, Any] = {}
    drain(engine, reply, results, steps=20)
    assert tokens_of(results[2]) == [full[0][:4], full[1]] and tokens_of(results[3]) == full
    assert [s["stop_reason"] for s in results[2]["samples"]] == ["stop", "length"]
    assert results[2]["samples"][0]["logprobs"].numel() == 4
    assert seen_logprobs[(2, 1)] == pytest.approx(results[2]["samples"][1]["logprobs"][:4].tolist(), abs=1e-6)
    # Stopping every sample finishes the request in that call.
    reply = step(engine, [(4, watched)], steps=1)
    reply = step(engine, steps=0, stop=[(4, 0), (4, 1)])
    assert [f["request_id"] for f in reply["finished"]] == [4] and reply["blocks_in_use"] == 0
    assert tokens_of(reply["finished"][0]["result"]) == [full[0][:2], full[1][:2]]


def test_sampling_survives_interleaved_training_and_adapter_removal(engine: Engine, reference_models: Path) -> None:
    """Training calls between sample_step calls (forward_backward, optim_step, an offload and
    reload of the trained adapter) leave running requests untouched; removing the adapter a
    request samples from drops it, reported as rejected "adapter removed"."""
    model_dir = reference_models / "qwen3"
    load(engine, model_dir)
    make_adapter(engine, None, "snap:1", 4, ALL_LINEAR + ["lm_head"], seed=3)
    make_adapter(engine, None, "snap:2", 2, ALL_LINEAR, seed=4)
    engine.call("create_adapter", {"adapter_id": "train", "rank": 4, "seed": 5})
    rows = sampled_rows(6, seed=5, adapters=["snap:1", "", "snap:2"])
    for r in rows:
        r["max_tokens"] = 14
    alone = [engine.call("sample", {"rows": [r]})["rows"][0] for r in rows]

    data = sequences(256, [20, 9], seed=8)
    train = {"ops": [{"adapter_id": "train", "loss": {"name": "cross_entropy"},
                      "datums": [{"input_tokens": s[:-1], "target_tokens": s[1:]} for s in data]}]}
    results: dict[int, Any] = {}
    reply = step(engine, list(enumerate(rows)), steps=2)
    for round_ in range(3):
        engine.call("forward_backward", train)
        engine.call("optim_step", {"adapter_id": "train", "hyper": {"learning_rate": 1e-2}})
        reply = step(engine, steps=1)
        for f in reply["finished"]:
            results[f["request_id"]] = f["result"]
        # Offload and reload the trained adapter between steps.
        state = engine.call("get_adapter_state", {"adapter_id": "train"})
        engine.call("remove_adapter", {"adapter_id": "train"})
        engine.call("create_adapter", state["config"])
        engine.call("set_adapter_state", {"adapter_id": "train", "weights": state["weights"],
                                          "optimizer": state["optimizer"], "optimizer_kind": state["optimizer_kind"]})
        engine.call("forward", {"ops": [{"adapter_id": "snap:1", "datums": [{"input_tokens": data[1]}]}]})
    drain(engine, reply, results, steps=3)
    for i in range(len(rows)):
        assert tokens_of(results[i]) == tokens_of(alone[i]), i

    # Removing a snapshot drops its running requests; the others go on.
    reply = step(engine, [(10, rows[0]), (11, rows[1]), (12, rows[2])], steps=1)
    assert reply["running"] == 3
    engine.call("remove_adapter", {"adapter_id": "snap:1"})
    reply = step(engine, steps=0)
    assert reply["rejected"] == [{"request_id": 10, "error": "adapter removed"}] and reply["running"] == 2
    results = {}
    drain(engine, reply, results)
    assert tokens_of(results[11]) == tokens_of(alone[1]) and tokens_of(results[12]) == tokens_of(alone[2])
    assert step(engine, steps=0)["blocks_in_use"] == 0
    with pytest.raises(EngineError, match="no adapter 'snap:1'"):
        engine.call("sample", {"rows": [rows[0]]})


def test_sampling_follows_adapter_weight_changes(engine: Engine, reference_models: Path) -> None:
    """Generation reads an adapter's weights as they are now: after optim_step and after
    set_adapter_state (in-place changes), sampled logprobs still equal the training forward."""
    model_dir = reference_models / "llama-llama3-rope"
    load(engine, model_dir)
    make_adapter(engine, None, "x", 4, ALL_LINEAR, seed=21)
    p = sequences(256, [11], seed=22)[0]
    r = row("x", p, max_tokens=8, temperature=1.0, seed=3)

    def check(label: str) -> list[int]:
        got = engine.call("sample", {"rows": [r]})["rows"][0]["samples"][0]
        seq = torch.cat([p, got["tokens"]])
        fwd = engine.call("forward", {"ops": [{"adapter_id": "x", "datums": [
            {"input_tokens": seq[:-1], "target_tokens": seq[1:]}]}]})["ops"][0]["logprobs"][0]
        assert_close(label, got["logprobs"], fwd[len(p) - 1:], 1e-5, absolute=True)
        return got["tokens"].tolist()

    before = check("before")
    engine.call("forward_backward", {"ops": [{"adapter_id": "x", "loss": {"name": "cross_entropy"},
                                              "datums": [{"input_tokens": p[:-1], "target_tokens": p[1:]}]}]})
    engine.call("optim_step", {"adapter_id": "x", "hyper": {"learning_rate": 0.5}})
    after_step = check("after optim_step")
    engine.call("set_adapter_state", {"adapter_id": "x", "weights": random_lora_state(engine, "x", seed=99)})
    after_set = check("after set_adapter_state")
    assert before != after_step or before != after_set


TOP_TOL = 1e-5  # logprobs against transformers; ids may differ only where neighbours are this close


def check_top(name: str, ids: torch.Tensor, lps: torch.Tensor, ref_lsm: torch.Tensor) -> float:
    """Top-k rows ([N, k] ids and logprobs from the engine) against torch.topk of the
    reference's log_softmax rows ([N, V]): logprobs position by position (both sorted), ids
    equal except where the reference's neighbouring logprobs are within TOP_TOL (there either
    order is right), every reported id's own reference logprob, and the documented order
    (descending logprob, equal ones by ascending id). Returns the largest logprob difference."""
    k = ids.shape[1]
    assert ids.dtype == torch.int64 and lps.dtype == torch.float32 and lps.shape == ids.shape
    assert ids.shape[0] == ref_lsm.shape[0], name
    ref_values, ref_ids = torch.topk(ref_lsm, k + 1, dim=1)  # one more: ties across the k-th place
    worst = assert_close(f"{name} top-{k} logprobs", lps, ref_values[:, :k], TOP_TOL, absolute=True)
    worst = max(worst, assert_close(f"{name} top-{k} logprobs of the reported ids", lps,
                                    ref_lsm.gather(1, ids), TOP_TOL, absolute=True))
    near = (ref_values[:, 1:] - ref_values[:, :-1]).abs() < TOP_TOL  # [N, k]: j ~ j + 1
    near_tie = torch.zeros(ids.shape, dtype=torch.bool)
    near_tie |= near[:, :k]                         # close to the next one
    near_tie[:, 1:] |= near[:, :k - 1]              # close to the previous one
    mismatched = ids != ref_ids[:, :k]
    assert not bool((mismatched & ~near_tie).any()), f"{name}: ids {ids.tolist()} != {ref_ids[:, :k].tolist()}"
    assert all(len(set(r)) == k for r in ids.tolist()), f"{name}: repeated ids"
    ordered = (lps[:, :-1] > lps[:, 1:]) | ((lps[:, :-1] == lps[:, 1:]) & (ids[:, :-1] < ids[:, 1:]))
    assert bool(ordered.all()), f"{name}: not in descending logprob / ascending id order"
    return worst


def test_top_logprobs_match_transformers_topk(engine: Engine, reference_models: Path) -> None:
    """Top-k ids and logprobs at generated and prompt positions, for a batch over the base model
    and four adapters (one with an lm_head LoRA) through sample_step, equal torch.topk of
    log_softmax of the transformers(+PEFT) logits over prompt + generated tokens; the sampled
    token's logprob is exactly its top-k entry whenever it is in the top k; rows that do not ask
    get nothing. One-shot sample gives the same numbers."""
    model_dir = reference_models / "qwen3"
    load(engine, model_dir, kv_block_size=4)
    refs = setup_adapters(engine, model_dir)
    prompts = sequences(256, [7, 1, 12, 19, 3, 25], seed=41)
    adapters = ["a", "b", "", "d", "c", "d"]
    # (top_logprobs, prompt_top_logprobs, want_prompt_logprobs): top-k with and without the
    # prompt's own logprobs, k = 1 and the cap, and a row asking for nothing.
    asks = [(5, 4, True), (3, 20, False), (20, 0, False), (1, 7, True), (0, 0, True), (8, 2, False)]
    # Rows 1 and 3 greedy: their token is the top-1 entry at every position.
    temperatures = [1.0, 0.0, 0.7, 0.0, 1.0, 1.3]
    rows = [row(a, p, temperature=temp, top_k=sample_top_k, top_p=0.95, seed=70 + i, num_samples=2, max_tokens=9,
                top_logprobs=k, prompt_top_logprobs=pk, want_prompt_logprobs=w)
            for i, (a, p, (k, pk, w), sample_top_k, temp) in enumerate(
                zip(adapters, prompts, asks, [0, 40, 0, 5, 0, 40], temperatures))]
    results: dict[int, Any] = {}
    drain(engine, step(engine, list(enumerate(rows)), steps=4), results)
    worst, in_top, checked = 0.0, 0, 0
    for i, (a, p, (k, pk, w)) in enumerate(zip(adapters, prompts, asks)):
        result = results[i]
        plen = len(p)
        if pk == 0:
            assert result["prompt_top_token_ids"] is None and result["prompt_top_logprobs"] is None
        if not w:
            assert result["prompt_logprobs"] is None
        for s, got in enumerate(result["samples"]):
            tokens = got["tokens"]
            assert len(tokens) == 9
            seq = torch.cat([p, tokens])
            with torch.no_grad():
                logits = refs[a](seq.unsqueeze(0)).logits[0].float()
            lsm = torch.log_softmax(logits, dim=-1)
            if k == 0:
                assert got["top_token_ids"] is None and got["top_logprobs"] is None
            else:
                ids, lps = got["top_token_ids"], got["top_logprobs"]
                assert ids.shape == (9, k)
                worst = max(worst, check_top(f"row{i} sample{s}", ids, lps, lsm[plen - 1:plen + 8]))
                if temperatures[i] == 0:
                    assert ids[:, 0].tolist() == tokens.tolist(), (i, s)
                for t in range(9):
                    hit = (ids[t] == tokens[t]).nonzero()
                    if len(hit):
                        in_top += 1
                        assert float(lps[t, int(hit[0, 0])]) == float(got["logprobs"][t]), (i, s, t)
                checked += 9
            if pk > 0 and s == 0:
                ids, lps = result["prompt_top_token_ids"], result["prompt_top_logprobs"]
                assert ids.shape == (plen - 1, pk) and lps.shape == (plen - 1, pk)
                if plen > 1:
                    worst = max(worst, check_top(f"row{i} prompt", ids, lps, lsm[:plen - 1]))
                    if w:  # the prompt token's own logprob is its top-k entry when it is there
                        for t in range(plen - 1):
                            hit = (ids[t] == p[t + 1]).nonzero()
                            if len(hit):
                                assert float(lps[t, int(hit[0, 0])]) == float(result["prompt_logprobs"][t])
    print(f"top-k: largest logprob difference vs transformers {worst:.3e}; sampled token in the top k "
          f"at {in_top}/{checked} positions")
    assert in_top >= 2 * 2 * 9  # at least the greedy rows' positions
    # One-shot sample of the same rows: the same tokens and top-k numbers.
    once = engine.call("sample", {"rows": rows})["rows"]
    for i in range(len(rows)):
        for key in ("prompt_top_token_ids", "prompt_top_logprobs"):
            assert (once[i][key] is None) == (results[i][key] is None)
            if once[i][key] is not None:
                assert torch.equal(once[i][key], results[i][key]), (i, key)
        for a_seq, b_seq in zip(once[i]["samples"], results[i]["samples"]):
            assert torch.equal(a_seq["tokens"], b_seq["tokens"])
            if b_seq["top_token_ids"] is not None:
                assert torch.equal(a_seq["top_token_ids"], b_seq["top_token_ids"])
                assert torch.equal(a_seq["top_logprobs"], b_seq["top_logprobs"])


def test_top_logprobs_limits(engine: Engine, reference_models: Path) -> None:
    """Widths outside [0, 64] are refused naming the field; max_tokens 0 and a one-token
    prompt give empty [0, k] top-k tensors."""
    model_dir = reference_models / "qwen3"
    load(engine, model_dir)
    p = torch.arange(1, 6)
    bad = {
        1: (row("", p, top_logprobs=65), "top_logprobs (65) must be in [0, 64]"),
        2: (row("", p, top_logprobs=-1), "top_logprobs (-1) must be in [0, 64]"),
        3: (row("", p, prompt_top_logprobs=65), "prompt_top_logprobs (65) must be in [0, 64]"),
    }
    reply = step(engine, [(i, r) for i, (r, _) in bad.items()], steps=0)
    assert {r["request_id"]: r["error"] for r in reply["rejected"]} == {i: e for i, (_, e) in bad.items()}
    for r, message in bad.values():
        with pytest.raises(EngineError, match=re.escape(f"row 0: {message}")):
            engine.call("sample", {"rows": [r]})
    out = engine.call("sample", {"rows": [row("", torch.tensor([5]), max_tokens=0, top_logprobs=3,
                                              prompt_top_logprobs=4, want_prompt_logprobs=True)]})["rows"][0]
    assert out["prompt_top_token_ids"].shape == (0, 4) and out["prompt_logprobs"].shape == (0,)
    assert out["samples"][0]["top_token_ids"].shape == (0, 3) and out["samples"][0]["top_logprobs"].shape == (0, 3)
