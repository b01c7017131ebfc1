#!/usr/bin/env python3
"""Sampler benchmark: prints a table, then `BENCH {json}` as the last line.

Figures (all on this machine, in one run; the model of bench_engine.py, ~48M parameters):
  multi_adapter_vs_base     decode tokens/s, 16 rows each on its own adapter (rank 16,
                            all-linear) / 16 base-only rows (goal >= 0.8)
  vs_hf_peft                our tokens/s generating the 16 rows (16 adapters) in one `sample`
                            call / transformers generate with PEFT, one adapter (row) at a
                            time, same prompts, greedy, same max_tokens (goal >= 10)
  continuous_tokens_per_s   generated tokens/s under Poisson arrivals of mixed requests
                            (16 adapters + base, varied prompts, max_tokens, num_samples),
                            driven through sample_step as the coordinator does
Decode rates are (t(max_tokens = 1 + N) - t(max_tokens = 1)) over N steps, so prefill is
left out; end-to-end rates include it. The engine is the real twinkle-engine process driven
over its IPC (tests/engine/engine_harness.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests/engine"))
sys.path.insert(0, str(ROOT / "tests/bench"))
from bench_engine import make_model  # noqa: E402  (the same model as the engine benchmark)
from engine_harness import Engine  # noqa: E402
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict  # noqa: E402
from transformers import Qwen3ForCausalLM  # noqa: E402

RANK, ALPHA = 16, 32.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS = 16
VOCAB = 8192


def prompts(n: int, seed: int, lo: int, hi: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(torch.randint(lo, hi + 1, (1,), generator=g)),), generator=g)
            for _ in range(n)]


def greedy_rows(adapters: list[str], ps: list[torch.Tensor], max_tokens: int) -> list[dict[str, Any]]:
    return [{"adapter_id": a, "prompt_tokens": p, "max_tokens": max_tokens, "temperature": 0.0}
            for a, p in zip(adapters, ps)]


def decode_rates(engine: Engine, configs: list[tuple[list[str], list[torch.Tensor]]], steps: int,
                 repeats: int) -> list[float]:
    """Per config (adapters, prompts): decode tokens/s over `steps` batched steps, prefill
    excluded. The configs are measured in turn within each repeat (medians over repeats), so
    a change in machine load hits them alike."""
    deltas: list[list[float]] = [[] for _ in configs]
    for rep in range(repeats + 1):  # the first round warms up
        for c, (adapters, ps) in enumerate(configs):
            times = []
            for max_tokens in (1, 1 + steps):
                rows = greedy_rows(adapters, ps, max_tokens)
                t = time.perf_counter()
                engine.call("sample", {"rows": rows})
                times.append(time.perf_counter() - t)
            if rep > 0:
                deltas[c].append(times[1] - times[0])
    return [len(ps) * steps / max(sorted(d)[len(d) // 2], 1e-9) for (_, ps), d in zip(configs, deltas)]


def random_lora(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: 0.02 * torch.randn(v.shape, generator=g) for k, v in state.items()}


def hf_peft_generator(model_dir: Path, weights: list[dict[str, torch.Tensor]], ps: list[torch.Tensor],
                      max_tokens: int) -> Callable[[], list[list[int]]]:
    """transformers generate with PEFT: each row on its own adapter, one at a time."""
    base = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    model = get_peft_model(base, config, adapter_name="t0")
    for i, w in enumerate(weights):
        if i > 0:
            model.add_adapter(f"t{i}", config)
        set_peft_model_state_dict(model, w, adapter_name=f"t{i}")
    model.eval()

    def run() -> list[list[int]]:
        out = []
        for i, p in enumerate(ps):
            model.set_adapter(f"t{i}")
            with torch.no_grad():
                seq = model.generate(input_ids=p.unsqueeze(0), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                     eos_token_id=None, pad_token_id=0)
            out.append(seq[0, len(p):].tolist())
        return out

    return run


def continuous(engine: Engine, adapters: list[str], rate: float, seconds: float, decode_steps: int,
               seed: int) -> dict[str, float]:
    """Poisson arrivals at `rate` requests/s for `seconds`, then drained; each sample_step call
    admits what has arrived (deferred requests first, in order) and runs `decode_steps` steps."""
    rng = random.Random(seed)
    arrivals: list[tuple[float, dict[str, Any]]] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t > seconds and arrivals:
            break
        p = prompts(1, rng.randrange(1 << 30), 8, 64)[0]
        arrivals.append((t, {"adapter_id": rng.choice(adapters + [""]), "prompt_tokens": p,
                             "max_tokens": rng.randint(16, 64), "temperature": 1.0, "top_p": 0.95,
                             "seed": rng.randrange(1 << 32), "num_samples": rng.choice([1, 1, 2, 4])}))
    start = time.perf_counter()
    next_arrival, waiting, latencies = 0, [], []
    submitted: dict[int, float] = {}
    generated, calls, running_sum = 0, 0, 0
    done = 0
    while done < len(arrivals):
        now = time.perf_counter() - start
        while next_arrival < len(arrivals) and arrivals[next_arrival][0] <= now:
            waiting.append(next_arrival)
            submitted[next_arrival] = arrivals[next_arrival][0]
            next_arrival += 1
        if not waiting and done == next_arrival:  # idle: wait for the next arrival
            time.sleep(max(0.0, arrivals[next_arrival][0] - now))
            continue
        reply = engine.call("sample_step", {"admit": [{"request_id": i, "row": arrivals[i][1]} for i in waiting],
                                            "max_decode_steps": decode_steps})
        calls += 1
        running_sum += reply["running"]
        assert not reply["rejected"], reply["rejected"]
        waiting = list(reply["deferred"])
        finished_at = time.perf_counter() - start
        for f in reply["finished"]:
            done += 1
            generated += sum(len(s["tokens"]) for s in f["result"]["samples"])
            latencies.append(finished_at - submitted[f["request_id"]])
    wall = time.perf_counter() - start
    latencies.sort()
    return {"tokens_per_s": generated / wall, "requests": len(arrivals), "generated_tokens": generated,
            "wall_s": wall, "p50_latency_s": latencies[len(latencies) // 2],
            "p90_latency_s": latencies[int(len(latencies) * 0.9)], "mean_running": running_sum / max(calls, 1),
            "calls": calls}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=14, help="14 layers = ~48M parameters (as bench_engine)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per rate")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per row, ours vs transformers+PEFT")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=20.0, help="Poisson arrival window")
    parser.add_argument("--load", type=float, default=1.5,
                        help="arrival rate as a multiple of what 16-row decoding sustains")
    parser.add_argument("--threads", type=int, default=0,
                        help="intra-op threads of the engine and of transformers (0 = torch's default); "
                             "1 is steadier on a machine shared with other jobs")
    args = parser.parse_args()
    if args.threads > 0:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the engine process inherits it
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    adapters = [f"t{i}" for i in range(ROWS)]
    ps = prompts(ROWS, seed=1, lo=16, hi=48)

    with tempfile.TemporaryDirectory(prefix="twinkle-bench-") as tmp:
        model_dir, params, _ = make_model(Path(tmp) / "model", args.layers)
        weights = []
        with Engine(timeout_s=600) as engine:
            info = engine.call("load_model", {"model_dir": str(model_dir), "dtype": "float32", "device": "cpu"})
            for i, a in enumerate(adapters):
                engine.call("create_adapter", {"adapter_id": a, "rank": RANK, "alpha": ALPHA, "seed": i})
                state = engine.call("get_adapter_state", {"adapter_id": a})["weights"]
                weights.append(random_lora(state, seed=100 + i))
                engine.call("set_adapter_state", {"adapter_id": a, "weights": weights[-1]})
            base_rate, multi_rate, single_rate = decode_rates(
                engine, [([""] * ROWS, ps), (adapters, ps), (adapters[:1], ps[:1])], args.steps, args.repeats)
            # Ours and transformers+PEFT in turn, medians over the repeats.
            rows = greedy_rows(adapters, ps, args.max_tokens)
            hf_run = hf_peft_generator(model_dir, weights, ps, args.max_tokens)
            t_ours, t_hf = [], []
            for rep in range(args.repeats + 1):
                t = time.perf_counter()
                reply = engine.call("sample", {"rows": rows})
                t_ours.append(time.perf_counter() - t)
                t = time.perf_counter()
                hf_tokens = hf_run()
                t_hf.append(time.perf_counter() - t)
            ours_tokens = [r["samples"][0]["tokens"].tolist() for r in reply["rows"]]
            ours_tps = ROWS * args.max_tokens / sorted(t_ours[1:])[args.repeats // 2]
            hf_tps = ROWS * args.max_tokens / sorted(t_hf[1:])[args.repeats // 2]
            mean_tokens = 40 * 2.0  # E[max_tokens] x E[num_samples] of the arrivals in continuous()
            rate = args.load * multi_rate / mean_tokens
            cont = continuous(engine, adapters, rate, args.seconds, decode_steps=4, seed=3)
            final = engine.call("sample_step", {"max_decode_steps": 0})
            assert final["blocks_in_use"] == 0 and final["running"] == 0
        agree = sum(a == b for a, b in zip(ours_tokens, hf_tokens))

    result = {
        "multi_adapter_vs_base": round(multi_rate / base_rate, 3),
        "vs_hf_peft": round(ours_tps / hf_tps, 2),
        "continuous_tokens_per_s": round(cont["tokens_per_s"], 1),
        "base_decode_tokens_per_s": round(base_rate, 1),
        "multi_adapter_decode_tokens_per_s": round(multi_rate, 1),
        "single_row_decode_tokens_per_s": round(single_rate, 1),
        "ours_tokens_per_s": round(ours_tps, 1),
        "hf_peft_tokens_per_s": round(hf_tps, 1),
        "greedy_rows_equal_to_hf": agree,
        "continuous_requests": cont["requests"],
        "continuous_arrival_rate": round(rate, 3),
        "continuous_p50_latency_s": round(cont["p50_latency_s"], 2),
        "continuous_p90_latency_s": round(cont["p90_latency_s"], 2),
        "continuous_mean_running": round(cont["mean_running"], 1),
        "kv_cache_blocks": info["kv_cache_blocks"],
        "kv_block_size": info["kv_block_size"],
        "params": params,
        "threads": threads,
    }
    table = [
        ("model parameters", f"{params / 1e6:.1f} M (Qwen3, {args.layers} layers), LoRA r={RANK} all-linear"),
        ("threads", str(threads)),
        ("decode tokens/s, 16 base-only rows", f"{base_rate:.1f}"),
        ("decode tokens/s, 16 rows x 16 adapters", f"{multi_rate:.1f}"),
        ("multi-adapter / base", f"{multi_rate / base_rate:.2f}  (goal >= 0.8)"),
        ("decode tokens/s, 1 row", f"{single_rate:.1f}"),
        (f"16 rows x {args.max_tokens} tokens, ours", f"{ours_tps:.1f} tokens/s"),
        (f"same, transformers+PEFT 1 row at a time", f"{hf_tps:.1f} tokens/s"),
        ("ours / transformers+PEFT", f"{ours_tps / hf_tps:.1f}x  (goal >= 10); {agree}/16 rows equal"),
        ("continuous: arrivals", f"{cont['requests']} requests, Poisson {rate:.2f}/s over {args.seconds:.0f} s"),
        ("continuous: generated tokens/s", f"{cont['tokens_per_s']:.1f} (mean {cont['mean_running']:.1f} running)"),
        ("continuous: latency p50 / p90", f"{cont['p50_latency_s']:.2f} s / {cont['p90_latency_s']:.2f} s"),
    ]
    width = max(len(r[0]) for r in table)
    for name, value in table:
        print(f"{name:<{width}}  {value}")
    print("BENCH " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
