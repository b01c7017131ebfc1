"""Data parallelism through the server (docs/device_pool.md): `engine.devices: [cpu, cpu]` (two
Gloo ranks) against `[cpu]`.

Adapter sharding: eight adapters train 20 rounds; each round all eight ops are queued while
the scheduler is paused, so they fuse into one engine step, which the data-parallel link
places on the adapters' home ranks (four each: no collective). Every adapter must end with the
weights the one-rank server gives it, and both ranks must have done work (the link's per-rank
token counts, logged at debug level). Tolerance: 1e-6 absolute on the weights, the
fused-equals-solo bound of test_multitenancy.py (an adapter is fused with other partners on
its rank than on one rank).

Batch splitting (one adapter's rows above engine.rank_token_budget over both ranks, its
gradient all-reduced), an adapter moved between ranks, and a rank's crash restoring only that
rank's adapters follow. The datum-by-datum split of sum losses is held to the one-rank step
in tests/engine/test_data_parallel.py.
"""

from __future__ import annotations

import re
import zlib
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
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
    sharded = two.stderr_text().count(f"(0 of {len(ADAPTERS)} trained adapters split)")
    print(f"2 ranks vs 1 rank, {len(ADAPTERS)} adapters x {ROUNDS} fused rounds: max |dw| = {worst:.3e}; "
          f"forward_backward tokens per rank: {totals}; steps sharded without a collective: {sharded}")
    assert worst <= 1e-6
    assert len(totals) == 2 and all(t > 0 for t in totals), totals
    assert sharded == ROUNDS


# ---- the datum-by-datum split, through the Tinker API ------------------------------------------

TINKER_STEPS = 5


def tinker_datum(tokens: list[int]) -> Any:
    from twinkle_client._proto.tinker.v1 import tinker_public_pb2 as tp

    return tp.Datum(
        model_input=[tp.Chunk(encoded_text=tp.EncodedTextChunk(tokens=np.asarray(tokens[:-1], np.int32).tobytes()))],
        loss_fn_inputs={"target_tokens": tp.Tensor(dense=np.asarray(tokens[1:], np.int64).tobytes(),
                                                   dtype=tp.DTYPE_INT64, shape=[len(tokens) - 1])})


def tinker_run(server: ServerProcess, vocab: int) -> tuple[list[float], list[np.ndarray]]:
    return tinker_run_with(server, vocab, TINKER_STEPS)


def tinker_run_with(server: ServerProcess, vocab: int, steps: int) -> tuple[list[float], list[np.ndarray]]:
    """`steps` steps of cross_entropy (a sum loss: its 4 datums split over the ranks),
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
    for _ in range(steps):
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
    """One adapter's 4-datum cross_entropy batch (44 tokens, above engine.rank_token_budget
    16) is split over the two ranks every step (each rank holds part of the rows, the LoRA
    gradients are all-reduced into the home rank's): the step losses equal
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
                                              engine={"devices": devices, "activation_memory_mib": budget,
                                                      "rank_token_budget": 16},
                                              logging={"level": "debug"}))
        results.append(tinker_run(server, vocab))
        if len(devices) == 2:
            totals = rank_totals(server.stderr_text())
            split_steps = server.stderr_text().count("forward_backward over 2 ranks (1 of 1 trained adapters split)")
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
    print(f"tokens per rank {totals}; split steps {split_steps}; steps run in 3 passes: {passes}")
    assert len(totals) == 2 and all(t > 0 for t in totals), totals
    assert split_steps == TINKER_STEPS, split_steps
    assert passes == TINKER_STEPS, passes


def engine_rank(proc: Any) -> int:
    cmd = proc.cmdline()
    return int(cmd[cmd.index("--rank") + 1])


def homes(logs: str) -> dict[str, int]:
    """adapter name -> home rank, from the link's debug lines (the latest wins)."""
    out: dict[str, int] = {}
    for name, rank in re.findall(r"adapter [^/\s]+/(\S+): home rank (\d+)", logs):
        out[name] = int(rank)
    for name, rank in re.findall(r"moved adapter [^/\s]+/(\S+) from rank \d+ to rank (\d+)", logs):
        out[name] = int(rank)
    return out


def step(c: Client, name: str, vocab: int, seed: int) -> None:
    c.call("ForwardBackward", tpb.ForwardRequest(adapter_name=name, inputs=batch(seed, vocab, sequences=2)))
    c.call("ClipGradAndStep", tpb.ClipGradNormRequest(adapter_name=name, max_grad_norm=1.0))


def test_killed_rank_restores_only_its_adapters(launch_server: LaunchServer, tiny_model: Path,
                                                 tmp_path: Path) -> None:
    """kill -9 of rank 1: rank 1 restarts alone (rank 0 keeps its pid), rank 0's adapter keeps
    its device state (its pending gradient included), rank 1's adapter goes back to its
    restore point (its last optimizer step, exactly) and its lost gradient is reported; then
    a split step (a Tinker batch above rank_token_budget) runs its all-reduce on the group
    re-formed at the next epoch."""
    import signal

    from e2e_support.waiting import wait_until

    from e2e_support.training import KEYS, auth_overrides

    vocab = vocab_size(tiny_model)
    server = launch_server(auth_overrides(engine={"devices": ["cpu", "cpu"], "restart_backoff_initial_ms": 100,
                                                  "rank_token_budget": 16},
                                          storage={"data_dir": str(tmp_path / "data")},
                                          logging={"level": "debug"}))
    c = Client(server.grpc_address, KEYS["alice"])
    for name in ("r0", "r1"):
        c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name=name, config=tpb.LoraConfig(r=4, seed=len(name))))
        c.call("SetOptimizer", tpb.SetOptimizerRequest(adapter_name=name, optimizer_cls="AdamW", config={"lr": LR}))
    for i in range(2):
        for name in ("r0", "r1"):
            step(c, name, vocab, 10 * i + len(name))
    assert homes(server.stderr_text()) == {"r0": 0, "r1": 1}, [l for l in server.stderr_text().splitlines() if "data-parallel" in l][:5]  # created on the engine at first use
    at_step = {name: state_dict(c, name) for name in ("r0", "r1")}
    for name in ("r0", "r1"):  # a pending gradient on each
        c.call("ForwardBackward", tpb.ForwardRequest(adapter_name=name, inputs=batch(77, vocab, sequences=2)))
    before = {engine_rank(p): p for p in server.engine_workers()}
    before[1].send_signal(signal.SIGKILL)

    def replaced() -> bool:
        # One snapshot: two reads could see the old rank 1 alive in the first and gone in
        # the second, before its replacement exists (and health is still SERVING).
        pids = {p.pid for p in server.engine_workers()}
        return len(pids) == 2 and before[1].pid not in pids

    wait_until(replaced, 120, "rank 1 replaced")
    server.wait_health("SERVING", 120)
    after = {engine_rank(p): p for p in server.engine_workers()}
    assert after[0].pid == before[0].pid, "rank 0 kept its process"
    # r0 was untouched: its pending gradient still counts, and its step applies it.
    c.call("ClipGradAndStep", tpb.ClipGradNormRequest(adapter_name="r0", max_grad_norm=1.0))
    assert any(float(np.abs(v - at_step["r0"][k]).max()) > 0 for k, v in state_dict(c, "r0").items())
    # r1 is back at its last optimizer step, exactly; its lost gradient is an error, once.
    with pytest.raises(grpc.RpcError) as lost:
        c.call("ClipGradAndStep", tpb.ClipGradNormRequest(adapter_name="r1", max_grad_norm=1.0))
    assert lost.value.code() == grpc.StatusCode.ABORTED and "lost" in (lost.value.details() or "")
    restored = state_dict(c, "r1")
    assert all(np.array_equal(restored[k], v) for k, v in at_step["r1"].items())
    step(c, "r1", vocab, 5)
    logs = server.stderr_text()
    assert "engine rank 1 restarts alone; the other ranks rejoin it at group epoch 1" in logs
    assert "adapter r1 restored to optimizer step" in logs and "adapter r0 restored" not in logs
    assert "its data-parallel group lost" not in logs
    # The group re-formed: a Tinker batch above rank_token_budget is split over both ranks.
    losses, _ = tinker_run_with(server, vocab, steps=2)
    assert len(losses) == 2
    assert server.stderr_text().count("(1 of 1 trained adapters split)") >= 2
    c.close()


def test_moved_adapter_continues_bit_identically(launch_server: LaunchServer, tiny_model: Path) -> None:
    """Three adapters created in turn get homes 0, 1, 0; with the one on rank 1 removed, rank 0
    carries all the load, and the link moves one of the others to rank 1 with its exact
    state. Its weights after 8 more steps are bit for bit those of the same run on a server
    that does not rebalance (engine.rebalance false: both stay on rank 0)."""
    vocab = vocab_size(tiny_model)
    finals = []
    for rebalance in (False, True):
        server = launch_server({"engine": {"devices": ["cpu", "cpu"], "rebalance": rebalance},
                                "logging": {"level": "debug"}})
        c = Client(server.grpc_address, None)
        for name in ("a", "gone", "b"):
            c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name=name, config=tpb.LoraConfig(r=4, seed=len(name) + 3)))
            c.call("SetOptimizer", tpb.SetOptimizerRequest(adapter_name=name, optimizer_cls="AdamW", config={"lr": LR}))
        c.call("RemoveAdapter", tpb.AdapterRequest(adapter_name="gone"))
        for i in range(8):
            for name in ("a", "b"):
                step(c, name, vocab, 100 * i + len(name))
        finals.append({name: state_dict(c, name) for name in ("a", "b")})
        logs = server.stderr_text()
        moved = re.findall(r"moved adapter [^/\s]+/(\S+) from rank 0 to rank 1", logs)
        print(f"rebalance {rebalance}: homes {homes(logs)}, moves {moved}")
        assert len(moved) == (1 if rebalance else 0), moved
        c.close()
        server.stop()
    for name in ("a", "b"):
        for k, v in finals[0][name].items():
            assert np.array_equal(finals[1][name][k], v), (name, k)
