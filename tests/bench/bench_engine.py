#!/usr/bin/env python3
"""Engine benchmark: prints a table, then `BENCH {json}` as the last line.

Figures (all on this machine, in one run, same thread count):
  gemm_gflops           measured fp32 matmul rate (LibTorch via torch, 2048^3)
  train_tokens_per_s    single-tenant LoRA training (forward_backward + optim_step), ~50M model
  mfu                   train_tokens_per_s * 4*P / gemm rate (frozen-base LoRA: ~4 P FLOPs/token;
                        P = the parameters one token uses: k of E routed experts on MoE)
  fused_vs_sequential   8 tenants x 1 seq x 128 tokens: one fused step vs one tenant at a time
  vs_peft               our single-tenant tokens/s / transformers+PEFT's, same model and batch
  ranks_speedup         with --ranks N (N > 1): one training step of 8 tenants x 2N x 128 tokens
                        on N data-parallel engines (one Gloo group, each with threads/N
                        threads; batch splitting: datums split over the ranks, gradients
                        all-reduced) vs one engine with all threads.
  ranks_sharded_speedup the same step with adapter sharding: tenant i's adapter lives on rank
                        i % N, which runs its whole batch; no collective.
                        On a machine whose cores are shared these figures say little; the ones
                        that matter are on N GPUs (docs/device_pool.md).
The engine is the real twinkle-engine process driven over its IPC (tests/engine/engine_harness.py).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests/engine"))
from engine_harness import Engine  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig  # noqa: E402
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig  # noqa: E402
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

RANK, ALPHA = 16, 32.0
HYPER = {"learning_rate": 1e-4, "weight_decay": 0.0}
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ATTENTION = TARGETS[:4]
# Qwen3.5's DeltaNet linears (all-linear includes them, as the engine's default does).
DELTANET = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"]
# LoRA targets per family, the same on both sides. The MoE families adapt attention (and the
# DeltaNet linears): PEFT adapts fused experts through target_parameters, a different code
# path from its LoRA Linear, so the comparison would no longer be like for like; the frozen
# experts' GEMMs still run forward and backward on both sides.
FAMILY_TARGETS = {"qwen3": TARGETS, "qwen3_5": TARGETS + DELTANET, "qwen3_moe": ATTENTION,
                  "qwen3_5_moe": ATTENTION + DELTANET}
DENSE = dict(vocab_size=8192, hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
             max_position_embeddings=1024, tie_word_embeddings=True)
# Three Gated DeltaNet layers to one gated full-attention layer, as published.
DELTANET_SHAPE = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
                      linear_value_head_dim=64)
# 16 experts, 2 routed per token: each token's routed MLP has half the dense one's width.
MOE = dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=384)


def make_model(out: Path, layers: int, family: str = "qwen3") -> tuple[Path, int, int]:
    """The model, its parameter count and the parameters one token uses (routed experts: k of E)."""
    torch.manual_seed(0)
    if family == "qwen3_5":
        model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**DENSE, **DELTANET_SHAPE, intermediate_size=1536,
                                                     num_hidden_layers=layers))
    elif family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**DENSE, **MOE, num_hidden_layers=layers, norm_topk_prob=True))
    elif family == "qwen3_5_moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**DENSE, **DELTANET_SHAPE, **MOE, num_hidden_layers=layers,
                                                           shared_expert_intermediate_size=512))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**DENSE, intermediate_size=1536, num_hidden_layers=layers))
    model.save_pretrained(out, safe_serialization=True)
    params = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    active = params - routed + routed * MOE["num_experts_per_tok"] // MOE["num_experts"]
    return out, params, active


def timed(fn: Callable[[], None], warmup: int, repeats: int) -> float:
    """Median seconds per call."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return sorted(samples)[len(samples) // 2]


def gemm_gflops() -> float:
    n = 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / timed(lambda: torch.mm(a, b), 2, 5) / 1e9


def batch(seqs: int, length: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(seqs):
        t = torch.randint(0, 8192, (length,), generator=g)
        out.append({"input_tokens": t, "target_tokens": torch.roll(t, -1)})
    return out


def engine_train_step(engine: Engine, ops: list[dict[str, object]]) -> None:
    engine.call("forward_backward", {"ops": ops})
    for op in ops:
        engine.call("optim_step", {"adapter_id": op["adapter_id"], "hyper": HYPER})


def op(adapter: str, datums: list[dict[str, torch.Tensor]]) -> dict[str, object]:
    return {"adapter_id": adapter, "datums": datums, "loss": {"name": "cross_entropy"}}


def ranks_speedup(model_dir: Path, ranks: int, threads: int, repeats: int,
                  targets: list[str]) -> tuple[float, float, float]:
    """Seconds of one 8-tenant training step on one engine, and on `ranks` engines of one
    process group, each with threads // ranks threads: batch splitting (datum d of every op
    on rank d % ranks, gradients all-reduced), then adapter sharding (tenant i on rank
    i % ranks, no collective)."""
    tenants = [op(f"t{i}", batch(2 * ranks, 128, seed=20 + i)) for i in range(8)]
    adapters = [o["adapter_id"] for o in tenants]

    def home(i: int, n: int) -> int:
        return i % n

    def create(engines: list[Engine], sharded: bool) -> None:
        ids = [e.submit("load_model", {"model_dir": str(model_dir), "dtype": "float32", "device": "cpu"})
               for e in engines]
        for e, i in zip(engines, ids):
            e.result(i)
        for i, a in enumerate(adapters):
            for r, e in enumerate(engines):
                if sharded and r != home(i, len(engines)):
                    continue
                e.call("create_adapter", {"adapter_id": a, "rank": RANK, "alpha": ALPHA, "seed": i,
                                          "targets": targets})

    def step(engines: list[Engine], sharded: bool) -> None:
        n = len(engines)
        if n == 1:
            parts = [{"ops": tenants}]
        elif sharded:
            parts = [{"ops": [o for i, o in enumerate(tenants) if home(i, n) == r]} for r in range(n)]
        else:
            parts = [{"ops": [{**o, "datums": o["datums"][r::n]} for o in tenants], "allreduce_adapters": adapters}
                     for r in range(n)]
        ids = [e.submit("forward_backward", b) for e, b in zip(engines, parts)]
        for e, i in zip(engines, ids):
            e.result(i)
        for k, a in enumerate(adapters):
            on = [e for r, e in enumerate(engines) if not sharded or r == home(k, n)]
            ids = [e.submit("optim_step", {"adapter_id": a, "hyper": HYPER}) for e in on]
            for e, i in zip(on, ids):
                e.result(i)

    with Engine() as one:
        create([one], False)
        t_one = timed(lambda: step([one], False), 1, repeats)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(max(1, threads // ranks))
    try:
        engines = [Engine(rank=r, extra_args=["--world-size", str(ranks), "--dist-port", str(port)])
                   for r in range(ranks)]
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    try:
        create(engines, False)
        t_many = timed(lambda: step(engines, False), 1, repeats)
        for a in adapters:
            for e in engines:
                e.call("remove_adapter", {"adapter_id": a})
        create_sharded = [e.call("create_adapter", {"adapter_id": a, "rank": RANK, "alpha": ALPHA, "seed": i,
                                                    "targets": targets})
                          for i, a in enumerate(adapters) for r, e in enumerate(engines) if r == home(i, ranks)]
        assert len(create_sharded) == len(adapters)
        t_sharded = timed(lambda: step(engines, True), 1, repeats)
    finally:
        for e in engines:
            e.close()
    return t_one, t_many, t_sharded


def peft_tokens_per_s(model_dir: Path, seqs: int, length: int, repeats: int, targets: list[str]) -> float:
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.0)
    data = batch(seqs, length, seed=1)
    inputs = torch.stack([d["input_tokens"] for d in data])
    targets = torch.stack([d["target_tokens"] for d in data])

    def step() -> None:
        logits = model(input_ids=inputs, use_cache=False).logits
        lp = torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        (-lp.sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return seqs * length / timed(step, 1, repeats)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=14, help="14 layers = ~48M parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1,
                        help="N > 1: also time a training step on N data-parallel CPU engines")
    parser.add_argument("--family", choices=sorted(FAMILY_TARGETS), default="qwen3",
                        help="qwen3_5(_moe): the hybrid Gated DeltaNet models (transformers' torch "
                             "fallbacks on the PEFT side, as on a machine without fla/causal_conv1d); "
                             "*_moe: routed experts (LoRA on attention, see FAMILY_TARGETS)")
    args = parser.parse_args()
    if args.ranks < 1:
        parser.error("--ranks must be >= 1")
    targets = FAMILY_TARGETS[args.family]
    threads = torch.get_num_threads()

    with tempfile.TemporaryDirectory(prefix="twinkle-bench-") as tmp:
        model_dir, params, active = make_model(Path(tmp) / "model", args.layers, args.family)
        gflops = gemm_gflops()
        with Engine() as engine:
            engine.call("load_model", {"model_dir": str(model_dir), "dtype": "float32", "device": "cpu"})
            for i in range(8):
                engine.call("create_adapter", {"adapter_id": f"t{i}", "rank": RANK, "alpha": ALPHA, "seed": i,
                                               "targets": targets})
            # Single tenant: 4 sequences x 128 tokens per step.
            single = [op("t0", batch(4, 128, seed=1))]
            t_single = timed(lambda: engine_train_step(engine, single), 1, args.repeats)
            train_tps = 4 * 128 / t_single
            # 8 tenants, 1 x 128 tokens each: fused in one pass vs one tenant at a time.
            tenants = [op(f"t{i}", batch(1, 128, seed=10 + i)) for i in range(8)]
            t_fused = timed(lambda: engine_train_step(engine, tenants), 1, args.repeats)
            t_seq = timed(lambda: [engine_train_step(engine, [o]) for o in tenants], 1, args.repeats)
        peft_tps = peft_tokens_per_s(model_dir, 4, 128, args.repeats, targets)
        t_one = t_many = t_sharded = 0.0
        if args.ranks > 1:
            t_one, t_many, t_sharded = ranks_speedup(model_dir, args.ranks, threads, args.repeats, targets)

    mfu = train_tps * 4 * active / (gflops * 1e9)
    result = {
        "gemm_gflops": round(gflops, 2),
        "train_tokens_per_s": round(train_tps, 1),
        "mfu": round(mfu, 3),
        "fused_vs_sequential": round(t_seq / t_fused, 3),
        "vs_peft": round(train_tps / peft_tps, 3),
        "peft_tokens_per_s": round(peft_tps, 1),
        "params": params,
        "active_params": active,
        "threads": threads,
        "family": args.family,
    }
    if args.ranks > 1:
        result["ranks"] = args.ranks
        result["ranks_speedup"] = round(t_one / t_many, 3)
        result["ranks_sharded_speedup"] = round(t_one / t_sharded, 3)
    rows = [
        ("model parameters", f"{params / 1e6:.1f} M, {active / 1e6:.1f} M per token ({args.family}, "
                             f"{args.layers} layers, LoRA r={RANK} on {len(targets)} kinds of linear)"),
        ("threads", str(threads)),
        ("fp32 GEMM (2048^3)", f"{gflops:.1f} GFLOP/s"),
        ("train tokens/s, 1 tenant 4x128", f"{train_tps:.1f}  (goal: 1.3x PEFT)"),
        ("transformers+PEFT tokens/s", f"{peft_tps:.1f}"),
        ("ours / PEFT", f"{train_tps / peft_tps:.2f}x"),
        ("MFU (4P FLOPs/token vs GEMM)", f"{mfu * 100:.1f}%  (goal >= 50%)"),
        ("8 tenants 1x128: fused step", f"{t_fused * 1000:.0f} ms"),
        ("8 tenants 1x128: one at a time", f"{t_seq * 1000:.0f} ms"),
        ("fused vs sequential", f"{t_seq / t_fused:.2f}x  (goal >= 2.0x)"),
    ]
    if args.ranks > 1:
        rows += [
            (f"8 tenants 2x{args.ranks}x128 step, 1 engine", f"{t_one * 1000:.0f} ms ({threads} threads)"),
            (f"same step, {args.ranks} data-parallel ranks", f"{t_many * 1000:.0f} ms ({max(1, threads // args.ranks)} threads each)"),
            (f"{args.ranks} ranks vs 1 rank", f"{t_one / t_many:.2f}x"),
            (f"same step, {args.ranks} ranks, adapters sharded", f"{t_sharded * 1000:.0f} ms (no collective)"),
            (f"{args.ranks} ranks sharded vs 1 rank", f"{t_one / t_sharded:.2f}x"),
        ]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print("BENCH " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
