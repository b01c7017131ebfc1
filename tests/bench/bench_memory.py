#!/usr/bin/env python3
"""Peak memory of one training step vs sequence length (issue 17 item 5).

A random Qwen3 with a realistic vocabulary (so the [tokens x vocab] logits matter) is written
to a temporary folder; for each sequence length and each engine setting a fresh
`twinkle-engine` worker loads it, creates a LoRA adapter (r 16, all-linear + lm_head),
runs one forward_backward of a single sequence of that length (cross_entropy), then one
optim_step, and reports the worker's peak RSS (VmHWM, /proc) and its RSS after loading
(VmRSS), so the step's own peak is their difference. Figures, never assertions.

Usage: tests/bench/bench_memory.py [--lengths 1024,2048,...] [--settings plain,checkpointed]
       [--vocab 32000] [--hidden 256] [--layers 4] [--engine-bin PATH]
Settings: plain (chunked log-probs), checkpointed (+ engine.activation_checkpointing),
whole (an engine binary from before chunking, --engine-bin, with no extra load options).
Prints one `MEMORY {...}` JSON line per run and a markdown table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from engine_harness import Engine  # noqa: E402


def make_model(out: Path, vocab: int, hidden: int, layers: int) -> Path:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64,
                         num_key_value_heads=max(1, hidden // 128), head_dim=64,
                         max_position_embeddings=65536, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    return out


def proc_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def run(model_dir: Path, length: int, setting: str, binary: Path | None, step: bool = True) -> dict[str, object]:
    options: dict[str, object] = {}
    if setting == "checkpointed":
        options["activation_checkpointing"] = True
    with Engine(binary=binary, timeout_s=3600) as engine:
        info = engine.call("load_model", {"model_dir": str(model_dir), "dtype": "float32", "device": "cpu", **options})
        engine.call("create_adapter", {"adapter_id": "a", "rank": 16, "alpha": 32.0, "seed": 1,
                                       "targets": ["all-linear", "lm_head"]})
        pid = engine.proc.pid
        loaded_kib = proc_kib(pid, "VmRSS")
        g = torch.Generator().manual_seed(length)
        tokens = torch.randint(0, int(info["vocab_size"]), (length,), generator=g)
        start = time.monotonic()
        reply = engine.call("forward_backward", {"ops": [{
            "adapter_id": "a", "loss": {"name": "cross_entropy"},
            "datums": [{"input_tokens": tokens, "target_tokens": torch.roll(tokens, -1),
                        "inputs": {"weights": torch.ones(length)}}]}]})
        seconds = time.monotonic() - start
        loss = reply["ops"][0]["metrics"]["loss:sum"]
        stepped = engine.call("optim_step", {"adapter_id": "a", "hyper": {"learning_rate": 1e-4}}) if step else {}
        peak_kib = proc_kib(pid, "VmHWM")
    logits_mib = length * int(info["vocab_size"]) * 4 / 2**20
    return {"setting": setting, "tokens": length, "peak_rss_mib": round(peak_kib / 1024, 1),
            "loaded_rss_mib": round(loaded_kib / 1024, 1), "step_peak_mib": round((peak_kib - loaded_kib) / 1024, 1),
            "logits_fp32_mib": round(logits_mib, 1), "forward_backward_s": round(seconds, 2),
            "loss_per_token": loss / length, "optim_step": stepped.get("step"),
            "loadavg": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    parser.add_argument("--settings", default="plain,checkpointed")
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--engine-bin", type=Path, default=None, help="the binary for the 'whole' setting")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    settings = args.settings.split(",")
    with tempfile.TemporaryDirectory(prefix="twinkle-bench-memory-") as tmp:
        model_dir = make_model(Path(tmp) / "model", args.vocab, args.hidden, args.layers)
        print(f"model: Qwen3 vocab {args.vocab}, hidden {args.hidden}, {args.layers} layers, fp32, CPU; "
              f"loadavg {os.getloadavg()}", flush=True)
        rows = []
        for length in lengths:
            for setting in settings:
                binary = args.engine_bin if setting == "whole" else None
                r = run(model_dir, length, setting, binary)
                rows.append(r)
                print("MEMORY " + json.dumps(r), flush=True)
    print("\n| tokens | setting | peak RSS MiB | step peak MiB (over loaded) | fp32 logits MiB | forward_backward s | loadavg |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['setting']} | {r['peak_rss_mib']} | {r['step_peak_mib']} | "
              f"{r['logits_fp32_mib']} | {r['forward_backward_s']} | {r['loadavg']:.2f} |")


if __name__ == "__main__":
    main()
