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


# ---- the datum-by-datum split, through the Tinker API ------------------------------------------

TINKER_STEPS = 5


def tinker_datum(tokens: list[int]) -> Any:
    from twinkle_client._proto.tinker.v1 import tinker_public_pb2 as tp

    return tp.Datum(
        model_input=[tp.Chunk(encoded_text=tp.EncodedTextChunk(tokens=np.asarray(tokens[:-1], np.int32).tobytes()))],
        loss_fn_inputs={"target_tokens": tp.Tensor(dense=np.asarray(tokens[1:], np.int64).tobytes(),
                                                   dtype=tp.DTYPE_INT64, shape=[len(tokens) - 1])})


def tinker_run(server: ServerProcess, vocab: int) -> tuple[list[float], list[np.ndarray]]:
    """TINKER_STEPS steps of cross_entropy (a sum loss: its 4 datums split over the ranks),
    then a forward-only pass: the per-step loss sums and the final per-datum log-probs."""
    from test_tinker_http import Api
    from twinkle_client._proto.tinker.v1 import tinker_public_pb2 as tp

    from e2e_support.training import KEYS

    api = Api(server, KEYS["alice"])
    model_id = api.create_model(rank=4)
    rng = np.random.default_rng(5)
    data = [tinker_datum(rng.integers(0, vocab, int(n)).tolist()) for n in (9, 17, 12, 6)]
    proto = {"Content-Type": "application/x-protobuf"}
    losses = []
    seq = 1
    for _ in range(TINKER_STEPS):
        body = tp.ForwardBackwardRequest(model_id=model_id, seq_id=seq, data=data, loss_fn="cross_entropy")
        rid = api.post("/forward_backward", data=body.SerializeToString(), headers=proto).json()["request_id"]
        losses.append(tp.ForwardBackwardOutput.FromString(api.result(rid, proto=True).content).metrics["loss:sum"])
        r = api.post("/optim_step", {"model_id": model_id, "seq_id": seq + 1, "adam_params": {"learning_rate": 1e-2}})
        api.result(r.json()["request_id"])
        seq += 2
    body = tp.ForwardBackwardRequest(model_id=model_id, seq_id=seq, data=data, loss_fn="cross_entropy",
                                     forward_only=True)
    rid = api.post("/forward_backward", data=body.SerializeToString(), headers=proto).json()["request_id"]
    out = tp.ForwardBackwardOutput.FromString(api.result(rid, proto=True).content)
    final = [np.frombuffer(o.fields["logprobs"].data, np.float32).copy() for o in out.loss_fn_outputs]
    return losses, final


def test_tinker_batch_split_over_two_ranks_equals_one(launch_server: LaunchServer, tiny_model: Path,
                                                      tmp_path: Path) -> None:
    """One adapter's 4-datum cross_entropy batch is split over the two ranks every step (each
    rank holds part of the rows, the LoRA gradients are all-reduced): the step losses equal
    the one-rank server's within 1e-6 relative, and after 5 AdamW steps the log-probs agree
    within 1e-4 (the Adam drift of tests/engine/test_data_parallel.py).

    The same batch on one rank under engine.activation_memory_mib 65 (the tiny model's
    estimate is 64 MiB fixed + ~52 KiB a token, so about 20 tokens a pass): the engine runs
    each step in 3 passes (8 | 16 | 11 + 5 tokens), with the same bounds."""
    from e2e_support.training import auth_overrides

    vocab = vocab_size(tiny_model)
    results = []
    for name, devices, budget in (("1 rank", ["cpu"], 0), ("2 ranks", ["cpu", "cpu"], 0),
                                  ("1 rank in passes", ["cpu"], 65)):
        server = launch_server(auth_overrides(storage={"data_dir": str(tmp_path / name.replace(" ", "-"))},
                                              engine={"devices": devices, "activation_memory_mib": budget},
                                              logging={"level": "debug"}))
        results.append(tinker_run(server, vocab))
        if len(devices) == 2:
            totals = rank_totals(server.stderr_text())
        if budget:
            passes = server.stderr_text().count("forward_backward in 3 passes within 65 MiB")
        server.stop()
    (one_losses, one_final) = results[0]
    assert len(set(one_losses)) == TINKER_STEPS, "training did not move the loss"
    for name, (losses, final) in zip(("2 ranks", "1 rank in passes"), results[1:]):
        rel = [abs(a - b) / abs(b) for a, b in zip(losses, one_losses)]
        worst_lp = max(float(np.abs(a - b).max()) for a, b in zip(final, one_final))
        print(f"tinker cross_entropy, 4 datums, {name}: step losses {one_losses} vs {losses}, "
              f"max relative diff {max(rel):.3e}; final log-probs max |diff| {worst_lp:.3e}")
        assert max(rel) <= 1e-6, name
        assert worst_lp <= 1e-4, name
    print(f"tokens per rank {totals}; steps run in 3 passes: {passes}")
    assert len(totals) == 2 and all(t > 0 for t in totals), totals
    assert passes == TINKER_STEPS, passes


def test_killed_rank_restarts_the_group_which_trains_again(launch_server: LaunchServer, tiny_model: Path) -> None:
    """kill -9 of rank 1: the supervisor takes rank 0 down too (a c10d group cannot take back
    one member), both restart on a new rendezvous, the server serves again, and a new
    adapter trains on the new group (a forward_backward runs its all-reduce on both ranks)."""
    import signal

    from e2e_support.waiting import wait_until

    vocab = vocab_size(tiny_model)
    server = launch_server({"engine": {"devices": ["cpu", "cpu"], "restart_backoff_initial_ms": 100},
                            "logging": {"level": "debug"}})
    before = server.engine_workers()
    assert len(before) == 2
    before[1].send_signal(signal.SIGKILL)
    wait_until(lambda: len(server.engine_workers()) == 2 and
               not ({w.pid for w in server.engine_workers()} & {w.pid for w in before}) or None,
               120, "both ranks replaced")
    server.wait_health("SERVING", 120)
    c = Client(server.grpc_address, None)
    c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name="after", config=tpb.LoraConfig(r=4, seed=1)))
    c.call("ForwardBackward", tpb.ForwardRequest(adapter_name="after", inputs=batch(3, vocab, sequences=2)))
    c.call("ClipGradAndStep", tpb.ClipGradNormRequest(adapter_name="after", max_grad_norm=1.0))
    assert any(float(np.abs(v).max()) > 0 for k, v in state_dict(c, "after").items() if "lora_B" in k)
    c.close()
    assert "its data-parallel group lost engine rank 1" in server.stderr_text()
