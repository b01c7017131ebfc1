"""Data parallelism through the server (docs/device_pool.md): `engine.devices: [cpu, cpu]` (two
Gloo ranks) against `[cpu]`. Eight adapters train 20 rounds; each round all eight ops are
queued while the scheduler is paused, so they fuse into one engine step, which the
data-parallel link splits over the two ranks. Every adapter must end with the weights the
one-rank server gives it, and both ranks must have done work (the coordinator's per-rank
token counts, logged at debug level).

Tolerance: 1e-6 absolute on the weights, the fused-equals-solo bound of
test_multitenancy.py. Twinkle's cross-entropy is a mean over a call's tokens, so each op goes
whole to one rank (docs/device_pool.md); its gradient is then computed over the same rows as
on one rank and the all-reduce adds exact zeros from the other rank. The datum-by-datum split
of sum losses is held to the one-rank step in tests/engine/test_data_parallel.py.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path
from typing import Any

import numpy as np
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb

from e2e_support.server import LaunchServer, ServerProcess
from e2e_support.training import Client, batch, state_dict

ADAPTERS = {f"t{i}": (2 + 2 * (i % 3), 100 + i) for i in range(8)}  # name -> (rank, seed)
ROUNDS = 20
LR = 1e-2


def vocab_size(model: Path) -> int:
    import json

    return int(json.loads((model / "config.json").read_text())["vocab_size"])


def train(server: ServerProcess, vocab: int) -> dict[str, dict[str, np.ndarray]]:
    c = Client(server.grpc_address, None)
    for name, (rank, seed) in ADAPTERS.items():
        c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name=name, config=tpb.LoraConfig(r=rank, seed=seed)))
        c.call("SetOptimizer", tpb.SetOptimizerRequest(adapter_name=name, optimizer_cls="AdamW", config={"lr": LR}))
    later = tpb.RequestOptions(return_future=True)
    for r in range(ROUNDS):
        c.call("PauseScheduler", tpb.Empty())
        futures = []
        for name in ADAPTERS:
            inputs = batch(zlib.crc32(f"{name}/{r}".encode()), vocab, sequences=2)
            futures.append(c.call("ForwardBackward", tpb.ForwardRequest(adapter_name=name, inputs=inputs,
                                                                         options=later)).future_id)
            futures.append(c.call("ClipGradAndStep", tpb.ClipGradNormRequest(adapter_name=name, max_grad_norm=1.0,
                                                                              options=later)).future_id)
        c.call("ResumeScheduler", tpb.Empty())
        for fid in futures:
            assert c.call("WaitFuture", tpb.WaitFutureRequest(future_id=fid, timeout_ms=60000)).done
    out = {name: state_dict(c, name) for name in ADAPTERS}
    c.close()
    return out


def rank_totals(logs: str) -> list[int]:
    """The last per-rank token totals the data-parallel link logged."""
    lines = [line for line in logs.splitlines() if "[data-parallel]" in line and "forward_backward" in line]
    assert lines, "no data-parallel step was logged"
    return [int(t) for t in re.findall(r"rank\d+=\d+ \(total (\d+)\)", lines[-1])]


def test_two_cpu_ranks_train_like_one(launch_server: LaunchServer, tiny_model: Path) -> None:
    vocab = vocab_size(tiny_model)
    common: dict[str, Any] = {"testing": {"hooks": True}}
    one = launch_server(common)
    reference = train(one, vocab)
    one.stop()
    two = launch_server({**common, "engine": {"devices": ["cpu", "cpu"]}, "logging": {"level": "debug"}})
    assert len(two.engine_workers()) == 2
    split = train(two, vocab)

    worst = 0.0
    for name in ADAPTERS:
        assert split[name].keys() == reference[name].keys()
        assert max(float(np.abs(v).max()) for k, v in reference[name].items() if "lora_B" in k) > 0
        for key, want in reference[name].items():
            worst = max(worst, float(np.abs(split[name][key] - want).max()))
    totals = rank_totals(two.stderr_text())
    print(f"2 ranks vs 1 rank, {len(ADAPTERS)} adapters x {ROUNDS} fused rounds: max |dw| = {worst:.3e}; "
          f"forward_backward tokens per rank: {totals}")
    assert worst <= 1e-6
    assert len(totals) == 2 and all(t > 0 for t in totals), totals
