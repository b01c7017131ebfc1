"""Data parallelism at the engine (docs/device_pool.md): two twinkle-engine workers in one c10d
process group (Gloo, CPU), each given half of a fused batch's datums, against one worker given
all of them. The split here is done by hand, as the coordinator's DataParallelLink does it;
tests/e2e/test_data_parallel.py runs the same through the server.

Tolerance. The two ranks' gradient is the sum of two partial gradients (each over half the
rows) where one rank sums all rows in one pass, so the two differ only by float32 summation
order: relative ~1e-7 per gradient (measured 7e-8 .. 1.1e-7). The issue's bound for one
step is 1e-6 relative, asserted on every step-1 gradient. After 8 AdamW steps the weights
are compared per element at 1e-4 absolute (lr 1e-2, so 1% of one step): Adam divides each
entry by sqrt(v), so an entry whose gradient is near zero turns ~1e-7 of summation noise into
a visible share of a step (measured worst: 1.0e-5, one element of one lora_A, whose gradient
starts at exactly zero while B is zero).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import load
from engine_harness import Engine, EngineError
from numerics import assert_close, relative_norm_error
from test_fused import ADAPTERS, HYPER, create, data
from test_memory_estimate import estimate_bytes

ABORTED, INVALID_ARGUMENT = 10, 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def group(world: int) -> Iterator[list[Engine]]:
    """`world` engines in one process group; rank 0 serves the rendezvous store."""
    port = free_port()
    with ExitStack() as stack:
        engines = [stack.enter_context(Engine(rank=r, extra_args=["--world-size", str(world), "--dist-port",
                                                                   str(port), "--dist-timeout-s", "60"]))
                   for r in range(world)]
        yield engines


def on_all(engines: list[Engine], method: str, bodies: list[dict[str, Any]] | dict[str, Any]) -> list[dict[str, Any]]:
    """Sends each engine its body (one for all, or one each) before waiting for any reply."""
    each = bodies if isinstance(bodies, list) else [bodies] * len(engines)
    ids = [e.submit(method, b) for e, b in zip(engines, each)]
    return [e.result(i) for e, i in zip(engines, ids)]


def on_all_errors(engines: list[Engine], method: str, bodies: list[dict[str, Any]]) -> list[EngineError | dict[str, Any]]:
    ids = [e.submit(method, b) for e, b in zip(engines, bodies)]
    out: list[EngineError | dict[str, Any]] = []
    for e, i in zip(engines, ids):
        try:
            out.append(e.result(i))
        except EngineError as err:
            out.append(err)
    return out


# Per rank (scripts/gpu_check.sh: "cuda:0,cuda:1", an NCCL group); default two CPU ranks (Gloo).
RANK_DEVICES = os.environ.get("TWINKLE_TEST_DEVICES", "cpu,cpu").split(",")


def load_group(engines: list[Engine], model_dir: Path) -> dict[str, Any]:
    """Loads the model on every rank; returns rank 0's load reply."""
    bodies = [{"model_dir": str(model_dir), "dtype": "float32", "device": RANK_DEVICES[r % len(RANK_DEVICES)]}
              for r in range(len(engines))]
    replies = on_all(engines, "load_model", bodies)
    assert [r["world_size"] for r in replies] == [len(engines)] * len(engines)
    return replies[0]


def op(adapter: str, datums: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    return {"adapter_id": adapter, "datums": datums, "loss": {"name": "cross_entropy"}}


def split_round(round_: int) -> list[dict[str, Any]]:
    """Per rank, its forward_backward body: datum 0 of every op on rank 0, datum 1 on rank 1."""
    trained = list(ADAPTERS)
    return [{"ops": [op(a, [data(a, round_)[k]]) for a in ADAPTERS], "allreduce_adapters": trained}
            for k in range(2)]


def states(engine: Engine) -> dict[str, dict[str, Any]]:
    return {a: engine.call("get_adapter_state", {"adapter_id": a}) for a in ADAPTERS}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


ROUNDS = 8
# Per element, after 8 AdamW steps at lr 1e-2 (module docstring): 1% of one step's size.
WEIGHT_TOL = 1e-4


def test_two_ranks_train_like_one(reference_models: Path) -> None:
    model_dir = reference_models / "qwen3"
    with Engine() as solo:
        load(solo, model_dir)
        for a in ADAPTERS:
            create(solo, a)
        solo_logprobs = []
        first_grads: dict[str, dict[str, torch.Tensor]] = {}
        for r in range(ROUNDS):
            reply = solo.call("forward_backward", {"ops": [op(a, data(a, r)) for a in ADAPTERS]})
            solo_logprobs.append(reply)
            if r == 0:
                first_grads = {a: s["grads"] for a, s in states(solo).items()}
            for a in ADAPTERS:
                solo.call("optim_step", {"adapter_id": a, "hyper": HYPER})
        solo_state = states(solo)

    with group(2) as ranks:
        load_group(ranks, model_dir)
        for a in ADAPTERS:
            on_all(ranks, "create_adapter", {"adapter_id": a, "rank": ADAPTERS[a], "alpha": 16.0, "seed": ord(a)})
        for r in range(ROUNDS):
            replies = on_all(ranks, "forward_backward", split_round(r))
            # Round 0 runs on equal weights: the log-probs agree to 1e-6. Later rounds run on
            # weights that differ by the (<= 1e-5) drift checked below, which shows in them.
            tol = 1e-6 if r == 0 else 1e-4
            for o in range(len(ADAPTERS)):
                for k in range(2):  # rank k ran datum k of every op
                    assert_close(f"round {r} op {o} datum {k} logprobs", replies[k]["ops"][o]["logprobs"][0],
                                 solo_logprobs[r]["ops"][o]["logprobs"][k], tol)
            if r == 0:
                grads = [states(e) for e in ranks]
                for a in ADAPTERS:
                    # Every rank holds the gradient of the whole batch, and the same one.
                    assert max_abs_diff(grads[0][a]["grads"], grads[1][a]["grads"]) == 0.0
                    for name, g in first_grads[a].items():
                        if float(g.norm()) > 0:
                            relative_norm_error(f"{a} step-1 gradient {name}", grads[1][a]["grads"][name], g, 1e-6)
            for a in ADAPTERS:
                on_all(ranks, "optim_step", {"adapter_id": a, "hyper": HYPER})
        rank_states = [states(e) for e in ranks]

    for a in ADAPTERS:
        assert rank_states[0][a]["step"] == rank_states[1][a]["step"] == solo_state[a]["step"] == ROUNDS
        # Identical replicas: the same summed gradient and the same optimizer on each rank.
        assert max_abs_diff(rank_states[0][a]["weights"], rank_states[1][a]["weights"]) == 0.0
        assert max_abs_diff(rank_states[0][a]["optimizer"], rank_states[1][a]["optimizer"]) == 0.0
        assert all(float(w.abs().max()) > 0 for n, w in solo_state[a]["weights"].items() if "lora_B" in n)
        for name, w in solo_state[a]["weights"].items():
            assert_close(f"{a} after {ROUNDS} steps {name}", rank_states[0][a]["weights"][name], w, WEIGHT_TOL,
                         absolute=True)


def test_half_the_batch_alone_differs(reference_models: Path) -> None:
    """Guards the test above: a rank that did NOT sum over the group (one half of the batch)
    ends elsewhere, so the equality there is the all-reduce's doing."""
    model_dir = reference_models / "qwen3"
    with Engine() as full, Engine() as half:
        for e in (full, half):
            load(e, model_dir)
            create(e, "a")
        full.call("forward_backward", {"ops": [op("a", data("a", 0))]})
        half.call("forward_backward", {"ops": [op("a", data("a", 0)[:1])]})
        g_full = full.call("get_adapter_state", {"adapter_id": "a"})["grads"]
        g_half = half.call("get_adapter_state", {"adapter_id": "a"})["grads"]
    name = next(n for n in g_full if "lora_B" in n)
    assert float((g_full[name] - g_half[name]).norm()) > 1e-3 * float(g_full[name].norm())


def test_rank_without_rows_and_failed_steps(reference_models: Path) -> None:
    """A rank with no rows of a step still joins its all-reduce (and gets the gradient); a
    step that fails on one rank fails on every rank and leaves every gradient as it was."""
    model_dir = reference_models / "qwen3"
    with group(2) as ranks:
        load_group(ranks, model_dir)
        on_all(ranks, "create_adapter", {"adapter_id": "a", "rank": 2, "alpha": 16.0, "seed": ord("a")})
        on_all(ranks, "forward_backward", [{"ops": [op("a", data("a", 0))], "allreduce_adapters": ["a"]},
                                           {"ops": [], "allreduce_adapters": ["a"]}])
        g0, g1 = (e.call("get_adapter_state", {"adapter_id": "a"}) for e in ranks)
        assert max_abs_diff(g0["grads"], g1["grads"]) == 0.0
        assert g0["micro_batches_since_step"] == g1["micro_batches_since_step"] == 1
        name = next(n for n in g0["grads"] if "lora_B" in n)
        assert float(g1["grads"][name].abs().max()) > 0

        bad = [{"input_tokens": torch.tensor([1, 2, 999]), "target_tokens": torch.tensor([1, 2, 3])}]
        out = on_all_errors(ranks, "forward_backward", [{"ops": [op("a", data("a", 1))], "allreduce_adapters": ["a"]},
                                                        {"ops": [op("a", bad)], "allreduce_adapters": ["a"]}])
        assert isinstance(out[0], EngineError) and out[0].code == ABORTED, out[0]
        assert "other rank" in out[0].message
        assert isinstance(out[1], EngineError) and out[1].code == INVALID_ARGUMENT, out[1]
        after = [e.call("get_adapter_state", {"adapter_id": "a"}) for e in ranks]
        for state in after:
            assert max_abs_diff(state["grads"], g0["grads"]) == 0.0
            assert state["micro_batches_since_step"] == 1
        # The group still works after a failed step.
        on_all(ranks, "forward_backward", [{"ops": [op("a", data("a", 2))], "allreduce_adapters": ["a"]},
                                           {"ops": [], "allreduce_adapters": ["a"]}])
        assert ranks[1].call("get_adapter_state", {"adapter_id": "a"})["micro_batches_since_step"] == 2


def test_single_worker_refuses_allreduce(reference_models: Path) -> None:
    with Engine() as engine:
        load(engine, reference_models / "qwen3")
        create(engine, "a")
        with pytest.raises(EngineError) as e:
            engine.call("forward_backward", {"ops": [op("a", data("a", 0))], "allreduce_adapters": ["a"]})
        assert e.value.code == INVALID_ARGUMENT and "process group" in e.value.message


def test_a_rank_runs_its_share_in_passes(reference_models: Path) -> None:
    """Data parallelism and the memory budget together: rank 0 gets two rounds' datums of
    every adapter with a max_pass_bytes that holds about one sequence (several passes), rank
    1 one round's in one pass; after the all-reduce both hold the one-rank gradient of all
    the rows (1e-6 relative), bit-identical to each other."""
    model_dir = reference_models / "qwen3"
    with Engine() as solo:
        load(solo, model_dir)
        for a in ADAPTERS:
            create(solo, a)
        solo.call("forward_backward", {"ops": [op(a, data(a, 0) + data(a, 1) + data(a, 2)) for a in ADAPTERS]})
        want = states(solo)
    with group(2) as ranks:
        info = load_group(ranks, model_dir)
        for a in ADAPTERS:
            on_all(ranks, "create_adapter", {"adapter_id": a, "rank": ADAPTERS[a], "alpha": 16.0, "seed": ord(a)})
        budget = estimate_bytes(info, [12])
        on_all(ranks, "forward_backward", [
            {"ops": [op(a, data(a, 0) + data(a, 1)) for a in ADAPTERS], "allreduce_adapters": list(ADAPTERS),
             "max_pass_bytes": budget},
            {"ops": [op(a, data(a, 2)) for a in ADAPTERS], "allreduce_adapters": list(ADAPTERS)}])
        got = [states(e) for e in ranks]
    for a in ADAPTERS:
        assert max_abs_diff(got[0][a]["grads"], got[1][a]["grads"]) == 0.0
        assert got[0][a]["micro_batches_since_step"] == 1
        for name, g in want[a]["grads"].items():
            relative_norm_error(f"{a} grad {name}", got[0][a]["grads"][name], g, 1e-6)


def test_sharded_and_split_adapters_in_one_step(reference_models: Path) -> None:
    """Adapter sharding next to batch splitting in one fused step: "b" runs whole on rank 0
    (not in allreduce_adapters, so its gradient stays there, equal to one rank's), while "a"
    is split over both ranks and all-reduced. Rank 1 never holds "b"."""
    model_dir = reference_models / "qwen3"
    with Engine() as solo:
        load(solo, model_dir)
        for a in ("a", "b"):
            solo.call("create_adapter", {"adapter_id": a, "rank": 2, "alpha": 16.0, "seed": ord(a)})
        solo.call("forward_backward", {"ops": [op("a", data("a", 0)), op("b", data("b", 0))]})
        want = {a: solo.call("get_adapter_state", {"adapter_id": a})["grads"] for a in ("a", "b")}
    with group(2) as ranks:
        load_group(ranks, model_dir)
        on_all(ranks, "create_adapter", {"adapter_id": "a", "rank": 2, "alpha": 16.0, "seed": ord("a")})
        ranks[0].call("create_adapter", {"adapter_id": "b", "rank": 2, "alpha": 16.0, "seed": ord("b")})
        a_rows = data("a", 0)
        on_all(ranks, "forward_backward", [
            {"ops": [op("a", a_rows[:1]), op("b", data("b", 0))], "allreduce_adapters": ["a"]},
            {"ops": [op("a", a_rows[1:])], "allreduce_adapters": ["a"]}])
        got_b = ranks[0].call("get_adapter_state", {"adapter_id": "b"})["grads"]
        assert max_abs_diff(got_b, want["b"]) <= 1e-6 * max(float(v.abs().max()) for v in want["b"].values())
        for e in ranks:
            got_a = e.call("get_adapter_state", {"adapter_id": "a"})["grads"]
            for k, v in want["a"].items():
                if float(v.norm()) > 0:
                    relative_norm_error(f"a grad {k}", got_a[k], v, 1e-6)
        with pytest.raises(EngineError) as e:
            ranks[1].call("get_adapter_state", {"adapter_id": "b"})
        assert "no adapter 'b'" in e.value.message


def test_a_replaced_rank_rejoins_the_survivors(reference_models: Path) -> None:
    """kill -9 of rank 1: rank 0's next all-reduce fails (its group lost a member), rank 0
    keeps its process and adapters; a new rank 1 started at group epoch 1 and rank 0 told
    rejoin_group(1) form the group again at their next collective, and a split step runs.
    An epoch older than the rank's is refused."""
    model_dir = reference_models / "qwen3"
    port = free_port()
    args = ["--world-size", "2", "--dist-port", str(port), "--dist-timeout-s", "30"]
    with Engine(rank=0, extra_args=args) as rank0:
        first = Engine(rank=1, extra_args=args)
        ranks = [rank0, first]
        load_group(ranks, model_dir)
        on_all(ranks, "create_adapter", {"adapter_id": "a", "rank": 2, "alpha": 16.0, "seed": ord("a")})
        rows = data("a", 0)
        on_all(ranks, "forward_backward", [{"ops": [op("a", rows[:1])], "allreduce_adapters": ["a"]},
                                           {"ops": [op("a", rows[1:])], "allreduce_adapters": ["a"]}])
        kept = rank0.call("get_adapter_state", {"adapter_id": "a"})
        first.proc.kill()
        first.proc.wait()
        first.close()
        with pytest.raises(EngineError) as e:
            rank0.call("forward_backward", {"ops": [op("a", rows[:1])], "allreduce_adapters": ["a"]})
        assert "all-reduce" in e.value.message or "process group" in e.value.message, e.value.message
        after = rank0.call("get_adapter_state", {"adapter_id": "a"})
        assert max_abs_diff(after["grads"], kept["grads"]) == 0.0, "a failed step left the gradients alone"
        with Engine(rank=1, extra_args=[*args, "--group-epoch", "1"]) as second:
            ranks = [rank0, second]
            second.call("load_model", {"model_dir": str(model_dir), "dtype": "float32", "device": RANK_DEVICES[1 % len(RANK_DEVICES)]})
            assert rank0.call("rejoin_group", {"epoch": 1}) == {"epoch": 1}
            with pytest.raises(EngineError) as e:
                rank0.call("rejoin_group", {"epoch": 0})
            assert "older" in e.value.message
            second.call("create_adapter", {"adapter_id": "a", "rank": 2, "alpha": 16.0, "seed": ord("a")})
            on_all(ranks, "forward_backward", [{"ops": [op("a", rows[:1])], "allreduce_adapters": ["a"]},
                                               {"ops": [op("a", rows[1:])], "allreduce_adapters": ["a"]}])
            g0, g1 = (r.call("get_adapter_state", {"adapter_id": "a"}) for r in ranks)
            assert g0["micro_batches_since_step"] == 2 and g1["micro_batches_since_step"] == 1
            name = next(n for n in g1["grads"] if "lora_B" in n)
            # Rank 0 holds both steps' gradients, rank 1 (fresh, same weights) the second's:
            # rank 0's minus its earlier equals rank 1's.
            assert torch.allclose(g0["grads"][name] - kept["grads"][name], g1["grads"][name], atol=1e-7)


@pytest.mark.parametrize("flag,value,ok", [
    ("--group-epoch", "0", True), ("--group-epoch", str(1 << 40), True),
    ("--group-epoch", "-1", False), ("--group-epoch", str((1 << 40) + 1), False),
    ("--world-size", "4096", True), ("--world-size", "4097", False), ("--world-size", "0", False),
    ("--dist-port", "65536", False), ("--dist-timeout-s", "86401", False), ("--dist-timeout-s", "0", False),
])
def test_distributed_flags_are_range_checked(flag: str, value: str, ok: bool) -> None:
    """Each of the engine's process-group flags at its limits and limit + 1: outside the range
    the engine exits at once (CLI11's validation error, 105) naming the flag and the range;
    inside it is accepted (a trailing --help makes the engine parse its flags and stop)."""
    import subprocess

    binary = Path(os.environ.get("TWINKLE_ENGINE_BIN", Path(__file__).resolve().parents[2] / "build/bin/twinkle-engine"))
    args = [str(binary), "--endpoint", "ipc:///nonexistent/engine.sock", "--dist-port", "29500", flag, value]
    r = subprocess.run([*args, "--help"], capture_output=True, text=True, timeout=60)
    if ok:
        assert r.returncode == 0, (r.returncode, r.stderr)
    else:
        assert r.returncode == 105 and flag in r.stderr and "not in range" in r.stderr, (r.returncode, r.stderr)
