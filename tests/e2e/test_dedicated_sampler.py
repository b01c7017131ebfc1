"""Dedicated sampler workers (sampler.devices: [cpu]): a second twinkle-engine process samples
while the training worker trains. Held against the colocated server, transformers + PEFT, the
server's own training forward and a solo training run; and a killed sampler worker recovers
without disturbing training."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import requests
import torch
from twinkle_client._proto.twinkle.v1 import sampler_pb2 as spb
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb
from twinkle_client._proto.twinkle.v1 import utility_pb2 as upb

from e2e_support import prom
from e2e_support.training import KEYS, Client, auth_overrides, state_dict
from e2e_support.waiting import scaled, wait_until
from test_sampler_service import (
    Sampler,
    compare_greedy,
    forward_logps,
    greedy_reference,
    prompts_for,
    train,
    trained_adapter,
    vocab,
)

LaunchServer = Callable[..., Any]

DEDICATED: dict[str, Any] = {"sampler": {"devices": ["cpu"]}}


def identity(worker: psutil.Process) -> str:
    cmdline = worker.cmdline()
    return cmdline[cmdline.index("--identity") + 1]


def sampler_worker(server: Any) -> psutil.Process:
    """The dedicated sampler worker: its routing identity starts with "sampler-"."""
    [worker] = [w for w in server.engine_workers() if identity(w).startswith("sampler-")]
    return worker


def training_worker(server: Any) -> psutil.Process:
    [worker] = [w for w in server.engine_workers() if identity(w).startswith("rank-")]
    return worker


def metrics(server: Any) -> list[prom.Sample]:
    return prom.parse(requests.get(server.http_url("/metrics"), timeout=10).text)


def sample_all(s: Sampler, sessions: dict[str, str], prompts: list[list[int]]) -> dict[str, Any]:
    """Greedy with prompt log-probs, and a seeded draw of 3 samples, from every session."""
    out = {}
    for kind, session in sessions.items():
        greedy = s.sample(session, prompts, max_tokens=10, temperature=0.0, prompt_logprobs=True)
        drawn = s.sample(session, prompts, max_tokens=10, temperature=1.0, top_p=0.95, seed=7, num_samples=3)
        out[kind] = (greedy, drawn)
    return out


def tokens_of(reply: spb.SampleResponse) -> list[list[list[int]]]:
    return [[list(q.tokens) for q in p.sequences] for p in reply.results]


def logprobs_of(reply: spb.SampleResponse) -> np.ndarray:
    return np.concatenate([np.asarray(q.logprobs, dtype=np.float64) for p in reply.results for q in p.sequences])


def wait_replayed_or_unavailable(s: Sampler, future: int, expected: list[list[list[int]]]) -> bool:
    """A request in flight when its worker was killed: True when it completed with the tokens
    of an undisturbed run (replayed on the new worker), False when it failed retryably."""
    while True:
        try:
            r = s.call("WaitSample", tpb.WaitFutureRequest(future_id=future, timeout_ms=10000))
        except grpc.RpcError as e:
            print(f"in-flight request: {e.code().name} ({e.details()})")
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            return False
        if r.done:
            assert tokens_of(r) == expected
            print("in-flight request: replayed on the new worker, the tokens of an undisturbed run")
            return True


def scenario(server: Any, n_vocab: int) -> tuple[Client, Sampler, dict[str, str], str, str]:
    """Trains adapter "rl" 3 steps; sessions on a live snapshot of it, on its sampler_weights
    checkpoint (saved at the same step) and on the base model."""
    c = Client(server.grpc_address, None)
    s = Sampler(c)
    trained_adapter(c, "rl", n_vocab)
    saved = c.call("Save", tpb.SaveRequest(adapter_name="rl", name="for-sampler", is_sampler=True))
    sessions = {
        "snapshot": s.call("SnapshotAdapter", spb.SnapshotAdapterRequest(adapter_name="rl")).sampling_session_id,
        "checkpoint": s.call("CreateSamplingSession",
                             spb.CreateSamplingSessionRequest(model_path=saved.twinkle_path)).sampling_session_id,
        "base": s.call("CreateSamplingSession", spb.CreateSamplingSessionRequest()).sampling_session_id,
    }
    return c, s, sessions, saved.twinkle_path, saved.checkpoint_dir


def test_dedicated_sampler_equals_colocated_peft_and_the_training_forward(
        launch_server: LaunchServer, tiny_model: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    n_vocab = vocab(tiny_model)
    prompts = prompts_for(5, n_vocab, 8)

    colocated = launch_server()
    assert len(colocated.engine_workers()) == 1
    c, s, sessions, _, _ = scenario(colocated, n_vocab)
    expected = sample_all(s, sessions, prompts)
    capacity = c.utility.GetCapacity(upb.GetCapacityRequest(), timeout=10)
    assert capacity.sampler_mode == "colocated" and capacity.sampler_ready
    colocated.stop()

    server = launch_server(DEDICATED)
    sampler, trainer = sampler_worker(server), training_worker(server)
    assert sampler.ppid() == server.pid and trainer.ppid() == server.pid
    assert "--device" in sampler.cmdline() and sampler.cmdline()[sampler.cmdline().index("--device") + 1] == "cpu"
    c, s, sessions, path, checkpoint_dir = scenario(server, n_vocab)
    got = sample_all(s, sessions, prompts)

    # Server info and capacity describe both pools.
    info = c.utility.GetServerInfo(upb.GetServerInfoRequest(), timeout=10)
    assert [(d.pool, d.rank, d.device, d.ready) for d in info.devices] == [
        ("training", 0, "cpu", True), ("sampler", 0, "cpu", True)]
    assert info.serving
    capacity = c.utility.GetCapacity(upb.GetCapacityRequest(), timeout=10)
    assert capacity.sampler_mode == "dedicated" and capacity.sampler_ready
    assert capacity.sampler_kv_blocks_total == 2048 and capacity.sampler_kv_block_size == 16
    assert capacity.sampler_snapshots == 2 and capacity.sampler_kv_blocks_in_use == 0
    samples = metrics(server)
    assert prom.value(samples, "twinkle_worker_up", pool="sampler", rank="0") == 1
    assert prom.value(samples, "twinkle_worker_up", pool="training", rank="0") == 1

    # The same tokens and log-probs as the colocated server, from every kind of session.
    for kind in sessions:
        for i in range(2):
            ours, theirs = got[kind][i], expected[kind][i]
            assert tokens_of(ours) == tokens_of(theirs), f"{kind}: dedicated and colocated differ"
            worst = float(np.max(np.abs(logprobs_of(ours) - logprobs_of(theirs))))
            print(f"{kind} {'greedy' if i == 0 else 'drawn'}: tokens equal, max |dlogp| vs colocated {worst:.2e}")
            assert worst <= 1e-5

    # Greedy = transformers + PEFT on the checkpoint; log-probs = the training forward.
    base = AutoModelForCausalLM.from_pretrained(str(tiny_model), torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, checkpoint_dir).eval()
    for kind in ("snapshot", "checkpoint"):
        full, worst_lp, worst_prompt = 0, 0.0, 0.0
        for prompt, result in zip(prompts, got[kind][0].results):
            seq = result.sequences[0]
            ref, gaps = greedy_reference(model, prompt, 10)
            full += compare_greedy(list(seq.tokens), ref, gaps)
            logps = forward_logps(c, "rl", prompt + list(seq.tokens))
            worst_lp = max(worst_lp, float(np.max(np.abs(np.asarray(seq.logprobs) - logps[len(prompt) - 1:]))))
            plp = np.asarray(result.prompt_logprobs, dtype=np.float64)
            assert len(plp) == len(prompt) and np.isnan(plp[0])
            worst_prompt = max(worst_prompt, float(np.max(np.abs(plp[1:] - logps[:len(prompt) - 1]))))
        print(f"{kind} ({path}): greedy vs transformers+PEFT {full}/{len(prompts)} to full length; "
              f"logprobs vs training forward {worst_lp:.2e}, prompt logprobs {worst_prompt:.2e}")
        assert full >= 0.9 * len(prompts)
        assert worst_lp <= 1e-5 and worst_prompt <= 1e-5

    # Sampling never touched the training worker: its KV cache is one block of 16 tokens, which
    # a prompt + 10 new tokens longer than that would not fit (it would have been refused).
    assert any(len(p) + 10 > 16 for p in prompts)
    stderr = server.stderr_text()
    assert "sampler engine rank 0 ready" in stderr, stderr
    # No worker went down on the way (a worker forked by a thread that then exits would be
    # killed by its parent-death signal).
    assert " is down" not in stderr, stderr


def test_dedicated_snapshot_keeps_its_weights_and_training_stays_exact(
        launch_server: LaunchServer, tiny_model: Path) -> None:
    n_vocab = vocab(tiny_model)
    server = launch_server({**DEDICATED, **auth_overrides()})
    alice, bob = Client(server.grpc_address, KEYS["alice"]), Client(server.grpc_address, KEYS["bob"])
    sa = Sampler(alice)
    # The reference: ten steps with nothing else running.
    trained_adapter(alice, "solo", n_vocab, steps=10)
    solo = state_dict(alice, "solo")

    # The same ten steps; a snapshot after two, and bob sampling all the while after it.
    trained_adapter(alice, "live", n_vocab, steps=2)
    prompt = prompts_for(9, n_vocab, 1)[0]
    before = forward_logps(alice, "live", prompt + prompt)
    snap = sa.call("SnapshotAdapter", spb.SnapshotAdapterRequest(adapter_name="live")).sampling_session_id
    first = sa.sample(snap, [prompt + prompt[:1]], max_tokens=6, temperature=0.0, prompt_logprobs=True).results[0]

    stop = threading.Event()
    counts = [0]
    errors: list[BaseException] = []

    def sample_forever() -> None:
        try:
            sb = Sampler(bob)
            base = sb.call("CreateSamplingSession", spb.CreateSamplingSessionRequest()).sampling_session_id
            while not stop.is_set():
                sb.sample(base, prompts_for(counts[0], n_vocab, 2), max_tokens=16, temperature=1.0, seed=counts[0])
                sa.sample(snap, [prompt], max_tokens=8, temperature=1.0, seed=counts[0])
                counts[0] += 1
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    thread = threading.Thread(target=sample_forever)
    thread.start()
    try:
        train(alice, "live", n_vocab, range(2, 10))
    finally:
        stop.set()
        thread.join()
    assert not errors, errors
    assert counts[0] > 0
    live = state_dict(alice, "live")
    worst = max(float(np.max(np.abs(solo[k] - live[k]))) for k in solo)
    print(f"{counts[0]} sampling rounds during 8 training steps; training vs solo max |dw| = {worst:.3e}")
    assert worst == 0.0

    after = forward_logps(alice, "live", prompt + prompt)
    assert np.max(np.abs(after - before)) > 1e-3, "training did not change the adapter"
    again = sa.sample(snap, [prompt + prompt[:1]], max_tokens=6, temperature=0.0, prompt_logprobs=True).results[0]
    assert list(again.sequences[0].tokens) == list(first.sequences[0].tokens)
    assert list(again.sequences[0].logprobs) == list(first.sequences[0].logprobs)
    snap_plp = np.asarray(again.prompt_logprobs[1:len(prompt) + 1], dtype=np.float64)
    print(f"snapshot vs the adapter at snapshot time {np.max(np.abs(snap_plp - before[:len(prompt)])):.2e}, "
          f"vs the adapter now {np.max(np.abs(snap_plp - after[:len(prompt)])):.2e}")
    assert np.max(np.abs(snap_plp - before[:len(prompt)])) <= 1e-5
    assert " is down" not in server.stderr_text(), server.logs()


def test_killed_sampler_worker_recovers_and_training_is_not_disturbed(
        launch_server: LaunchServer, tiny_model: Path) -> None:
    n_vocab = vocab(tiny_model)
    server = launch_server({**DEDICATED, "engine": {"restart_backoff_initial_ms": 200}})
    c, s, sessions, _, _ = scenario(server, n_vocab)
    prompts = prompts_for(21, n_vocab, 4)
    before = sample_all(s, sessions, prompts)
    long_request = spb.SampleRequest(
        sampling_session_id=sessions["snapshot"], prompts=[spb.Prompt(tokens=p) for p in prompts],
        params=spb.SamplingParams(max_tokens=400, temperature=1.0, seed=3, num_samples=8, ignore_eos=True))
    long_expected = tokens_of(s.call("Sample", long_request))
    # The training reference: five steps of "ref" before anything is killed.
    trained_adapter(c, "ref", n_vocab, steps=5)
    reference = state_dict(c, "ref")

    sampler, trainer = sampler_worker(server), training_worker(server)
    # In flight when the worker dies: replayed on the new worker (same tokens), or failed
    # retryably.
    long_request.options.return_future = True
    future = s.call("Sample", long_request).future_id
    trained_adapter(c, "during", n_vocab, steps=2)
    errors: list[BaseException] = []

    def keep_training() -> None:
        try:
            train(c, "during", n_vocab, range(2, 5))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    # Kill once the long request is in the worker's batch (it runs for seconds).
    wait_until(lambda: c.utility.GetCapacity(upb.GetCapacityRequest(), timeout=10).sampler_running > 0,
               scaled(30), "the long request running on the sampler worker")
    thread = threading.Thread(target=keep_training)
    thread.start()
    killed_at = time.monotonic()
    sampler.kill()
    # A request sent while the worker is down fails retryably (UNAVAILABLE) or waits for it.
    try:
        s.sample(sessions["base"], prompts[:1], max_tokens=4, temperature=0.0)
    except grpc.RpcError as e:
        print(f"sampling while the sampler worker is down: {e.code().name} ({e.details()})")
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
    thread.join()
    assert not errors, errors

    wait_until(lambda: any(w.pid != sampler.pid for w in server.engine_workers() if identity(w).startswith("sampler-")),
               scaled(30), "a new sampler worker")
    wait_until(lambda: c.utility.GetCapacity(upb.GetCapacityRequest(), timeout=10).sampler_ready, scaled(60),
               "the sampler worker ready again")
    server.wait_health("SERVING", scaled(60))
    print(f"sampler worker back {time.monotonic() - killed_at:.1f} s after the kill")
    new_sampler = sampler_worker(server)
    assert new_sampler.pid != sampler.pid and new_sampler.ppid() == server.pid
    assert training_worker(server).pid == trainer.pid, "the training worker was restarted"

    # Training went on, exactly.
    during = state_dict(c, "during")
    worst = max(float(np.max(np.abs(reference[k] - during[k]))) for k in reference)
    print(f"training across the sampler kill vs before it: max |dw| = {worst:.3e}")
    assert worst == 0.0

    # The in-flight request: the same tokens as before the kill, or a retryable error.
    if wait_replayed_or_unavailable(s, future, long_expected):
        assert "replaying the running sampling requests" in server.stderr_text()

    # Sessions survived: snapshots are rebuilt on the new worker, same results.
    after = sample_all(s, sessions, prompts)
    for kind in sessions:
        for i in range(2):
            assert tokens_of(after[kind][i]) == tokens_of(before[kind][i]), kind
            assert np.max(np.abs(logprobs_of(after[kind][i]) - logprobs_of(before[kind][i]))) <= 1e-5, kind
    samples = metrics(server)
    assert prom.value(samples, "twinkle_worker_restarts_total", pool="sampler", rank="0") == 1
    assert prom.value(samples, "twinkle_worker_restarts_total", pool="training", rank="0") == 0
    info = c.utility.GetServerInfo(upb.GetServerInfoRequest(), timeout=10)
    assert [(d.pool, d.ready, d.restarts) for d in info.devices] == [("training", True, 0), ("sampler", True, 1)]
    stderr = server.stderr_text()
    assert "sampler engine rank 0 is down" in stderr
    # The decode loop's retries while the worker was down are logged once per distinct error.
    failures = [line for line in stderr.splitlines() if "sample_step failed" in line]
    assert len(failures) == len({line.split("sample_step failed: ")[1] for line in failures}), failures

    # The other way round: a training-worker restart leaves sampling alone (the snapshots live
    # on the sampler worker only, so nothing is rebuilt or replayed).
    replays = stderr.count("replaying the running sampling requests")
    trainer.kill()
    wait_until(lambda: c.utility.GetServerInfo(upb.GetServerInfoRequest(), timeout=10).devices[0].restarts == 1,
               scaled(30), "the training worker restarted")
    server.wait_health("SERVING", scaled(60))
    again = sample_all(s, sessions, prompts)
    for kind in sessions:
        for i in range(2):
            assert tokens_of(again[kind][i]) == tokens_of(before[kind][i]), kind
    assert server.stderr_text().count("replaying the running sampling requests") == replays
    assert sampler_worker(server).pid == new_sampler.pid


def test_a_sampler_worker_that_cannot_start_fails_the_launch_naming_it(launch_server: LaunchServer) -> None:
    # No machine has a cuda:99; the training worker starts fine, the launch still exits 1.
    server = launch_server({"sampler": {"devices": ["cuda:99"]}}, wait=False)
    code = server.wait_exit(scaled(120))
    stderr = server.stderr_text()
    print(stderr.strip().splitlines()[-3] if stderr.strip() else "(no stderr)")
    assert code == 1, server.logs()
    assert "twinkle-server: sampler engine rank 0 on cuda:99 failed to start" in stderr, server.logs()
    assert not server.engine_workers()


POOL: dict[str, Any] = {"sampler": {"devices": ["cpu", "cpu"]}, "engine": {"restart_backoff_initial_ms": 200}}


def sampler_worker_of_rank(server: Any, rank: int) -> psutil.Process:
    [worker] = [w for w in server.engine_workers() if identity(w).startswith(f"sampler-rank-{rank}-")]
    return worker


def lane_loads(c: Client) -> list[upb.SamplerWorkerLoad]:
    return list(c.utility.GetCapacity(upb.GetCapacityRequest(), timeout=10).sampler_workers)


def sample_concurrently(s: Sampler, sessions: dict[str, str], prompts: list[list[int]]) -> dict[str, Any]:
    """sample_all's requests, every session's at once from threads of their own, so rows of
    different requests share the two workers' batches."""
    out: dict[str, Any] = {}
    errors: list[BaseException] = []

    def one(kind: str, session: str) -> None:
        try:
            out[kind] = sample_all(s, {kind: session}, prompts)[kind]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=item) for item in sessions.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return out


def test_two_sampler_workers_share_the_rows_and_one_restarts_alone(
        launch_server: LaunchServer, tiny_model: Path) -> None:
    n_vocab = vocab(tiny_model)
    prompts = prompts_for(31, n_vocab, 6)

    colocated = launch_server()
    _, s, sessions, _, _ = scenario(colocated, n_vocab)
    expected = sample_all(s, sessions, prompts)
    colocated.stop()

    server = launch_server(POOL)
    c, s, sessions, _, _ = scenario(server, n_vocab)
    info = c.utility.GetServerInfo(upb.GetServerInfoRequest(), timeout=10)
    assert [(d.pool, d.rank, d.device, d.ready) for d in info.devices] == [
        ("training", 0, "cpu", True), ("sampler", 0, "cpu", True), ("sampler", 1, "cpu", True)]
    got = sample_concurrently(s, sessions, prompts)

    # Both workers generated, and the results are the colocated server's, row for row: a
    # row's tokens depend on its own seed and weights, not on which worker ran it or beside what.
    loads = lane_loads(c)
    assert [(w.rank, w.device) for w in loads] == [(0, "cpu"), (1, "cpu")]
    print("tokens generated per sampler worker:", [w.tokens_generated for w in loads])
    assert all(w.tokens_generated > 0 for w in loads), loads
    assert all(w.kv_blocks_total == 2048 and w.kv_blocks_in_use == 0 for w in loads), loads
    capacity = c.utility.GetCapacity(upb.GetCapacityRequest(), timeout=10)
    assert capacity.sampler_mode == "dedicated" and capacity.sampler_kv_blocks_total == 2 * 2048
    for kind in sessions:
        for i in range(2):
            assert tokens_of(got[kind][i]) == tokens_of(expected[kind][i]), f"{kind}: two workers and colocated differ"
            assert np.max(np.abs(logprobs_of(got[kind][i]) - logprobs_of(expected[kind][i]))) <= 1e-5, kind

    # Kill rank 1 while a long request has rows on both workers: rank 0 goes on undisturbed,
    # rank 1's rows are replayed on its new process, and the request's tokens are unchanged.
    long_request = spb.SampleRequest(
        sampling_session_id=sessions["snapshot"], prompts=[spb.Prompt(tokens=p) for p in prompts[:4]],
        params=spb.SamplingParams(max_tokens=300, temperature=1.0, seed=5, num_samples=4, ignore_eos=True))
    long_expected = tokens_of(s.call("Sample", long_request))
    rank0, rank1 = sampler_worker_of_rank(server, 0), sampler_worker_of_rank(server, 1)
    long_request.options.return_future = True
    future = s.call("Sample", long_request).future_id
    wait_until(lambda: all(w.running > 0 for w in lane_loads(c)), scaled(30), "rows running on both sampler workers")
    rank1.kill()
    wait_until(lambda: any(identity(w).startswith("sampler-rank-1-") and w.pid != rank1.pid
                           for w in server.engine_workers()), scaled(30), "a new sampler rank 1")
    server.wait_health("SERVING", scaled(60))
    wait_replayed_or_unavailable(s, future, long_expected)
    assert sampler_worker_of_rank(server, 0).pid == rank0.pid, "sampler rank 0 was restarted"
    stderr = server.stderr_text()
    assert "sampler engine rank 1 is down" in stderr and "sampler engine rank 0 is down" not in stderr
    assert "lane 0: engine restarted" not in stderr, "rank 0's rows were replayed for rank 1's restart"
    samples = metrics(server)
    assert prom.value(samples, "twinkle_worker_restarts_total", pool="sampler", rank="1") == 1
    assert prom.value(samples, "twinkle_worker_restarts_total", pool="sampler", rank="0") == 0

    # Every session still gives the same results, its snapshot rebuilt on the new rank 1.
    after = sample_concurrently(s, sessions, prompts)
    for kind in sessions:
        for i in range(2):
            assert tokens_of(after[kind][i]) == tokens_of(expected[kind][i]), kind

    # Closing the sessions frees every snapshot on both workers.
    for session in sessions.values():
        s.call("CloseSamplingSession", spb.SamplingSessionRequest(sampling_session_id=session))
    wait_until(lambda: c.utility.GetCapacity(upb.GetCapacityRequest(), timeout=10).sampler_snapshots == 0,
               scaled(30), "the snapshots freed")
    assert "removing snapshot" not in server.stderr_text(), server.logs()
