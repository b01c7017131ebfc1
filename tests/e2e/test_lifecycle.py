"""One request lifecycle under every API, through the real server with auth on and two
tenants (alice and bob): idempotency keys scoped per adapter and op, Tinker model ids per
tenant, sampling sessions and snapshots that are released, so an RL loop runs in a bounded
footprint, seq_id gaps each timed on their own with buffered ops inside the tenant's limits."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import psutil
import pytest
import requests
from twinkle_client._proto.tinker.v1 import tinker_public_pb2 as tp
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb
from twinkle_client._proto.twinkle.v1 import utility_pb2 as upb

from e2e_support import prom
from e2e_support.server import LaunchServer, ServerProcess
from e2e_support.training import Client, KEYS, auth_overrides, batch, resolved
from e2e_support.waiting import scaled, wait_until
from test_tinker_http import MODEL_NAME, Api, fwdbwd_body

PROTO = {"Content-Type": "application/x-protobuf"}


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def model_dir(server: ServerProcess) -> Path:
    return Path(server.config["model"]["path"])


@pytest.fixture
def server(launch_server: LaunchServer, tmp_path: Path) -> ServerProcess:
    return launch_server(auth_overrides(storage={"data_dir": str(tmp_path / "data")}))


def new_model(api: Api) -> tuple[str, str]:
    """(session_id, model_id) of a fresh Tinker model."""
    session = api.post("/create_session", {"tags": []}).json()["session_id"]
    promise = api.post("/create_model", {"session_id": session, "model_seq_id": 0, "base_model": MODEL_NAME,
                                         "lora_config": {"rank": 4}})
    assert promise.status_code == 200, promise.text
    out = api.result(promise.json()["request_id"]).json()
    assert "model_id" in out, out
    return session, out["model_id"]


def assert_conflict(r: requests.Response, *needles: str) -> None:
    """A replayed key of another op: 400 (never retried by the SDK), naming the key."""
    assert r.status_code == 400, f"{r.status_code}: {r.text}"
    assert r.headers["x-should-retry"] == "false"
    body = r.json()
    assert body["code"] == "FAILED_PRECONDITION", body
    for needle in needles:
        assert needle in body["detail"], body


def served_forward_backward(api: Api, model_id: str, seq_id: int) -> float:
    """A forward_backward that runs to the end; its loss:sum."""
    r = api.post("/forward_backward", data=fwdbwd_body(model_id, seq_id), headers=PROTO)
    assert r.status_code == 200, r.text
    out = api.result(r.json()["request_id"]).json()
    assert "metrics" in out, out
    return float(out["metrics"]["loss:sum"])


def test_idempotency_collisions_get_a_clear_error_and_the_server_stays_up(server: ServerProcess) -> None:
    alice, bob = Api(server, KEYS["alice"]), Api(server, KEYS["bob"])
    session, model_id = new_model(alice)
    _, bob_model = new_model(bob)

    # 1. A Twinkle gRPC ForwardBackward on the Tinker model's adapter with the key the Tinker
    #    layer derives from seq_id 1, then a Tinker save_weights_for_sampler with seq_id 1:
    #    the key belongs to a forward_backward, so the snapshot is refused, naming the key
    #    (before: the forward_backward's result was cast to a sampling session: SIGABRT).
    grpc_alice = Client(server.grpc_address, KEYS["alice"])
    try:
        request = tpb.ForwardRequest(adapter_name=f"{session}.t0", inputs=batch(1, vocab_size(model_dir(server))),
                                     options=tpb.RequestOptions(idempotency_key="tinker-seq-1"))
        first = grpc_alice.call("ForwardBackward", request)
        assert first.result.loss > 0
        # The same request again is a retry: same answer, nothing new runs.
        assert grpc_alice.call("ForwardBackward", request).result.loss == first.result.loss
        # The same key with another body is refused.
        other = tpb.ForwardRequest(adapter_name=f"{session}.t0", inputs=batch(2, vocab_size(model_dir(server))),
                                   options=tpb.RequestOptions(idempotency_key="tinker-seq-1"))
        with pytest.raises(grpc.RpcError) as info:
            grpc_alice.call("ForwardBackward", other)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION, info.value.details()
        assert "'tinker-seq-1'" in info.value.details() and "different request body" in info.value.details()
    finally:
        grpc_alice.close()
    assert_conflict(alice.post("/save_weights_for_sampler", {"model_id": model_id, "seq_id": 1}),
                    "'tinker-seq-1'", "forward_backward")
    assert server.proc.poll() is None, server.logs()

    # 2. One Tinker seq_id reused across forward_backward, optim_step and
    #    save_weights_for_sampler: the first wins, the others are refused naming the seq_id.
    served_forward_backward(alice, model_id, 2)
    assert_conflict(alice.post("/optim_step", {"model_id": model_id, "seq_id": 2,
                                               "adam_params": {"learning_rate": 1e-3}}),
                    "seq_id 2", "forward_backward")
    assert_conflict(alice.post("/save_weights_for_sampler", {"model_id": model_id, "seq_id": 2}),
                    "seq_id 2", "forward_backward")
    # A forward_backward replayed with another body under seq_id 2 is refused too...
    assert_conflict(alice.post("/forward_backward", data=fwdbwd_body(model_id, 2, forward_only=True), headers=PROTO),
                    "seq_id 2")
    # ...while a true retry (same body) gets the first request's id.
    again = alice.post("/forward_backward", data=fwdbwd_body(model_id, 2), headers=PROTO)
    assert again.status_code == 200, again.text
    assert server.proc.poll() is None, server.logs()

    # The server is up for both tenants: bob's forward_backward is served, and alice goes on
    # with the next seq_id.
    bob_loss = served_forward_backward(bob, bob_model, 1)
    assert bob_loss > 0
    step = alice.post("/optim_step", {"model_id": model_id, "seq_id": 3, "adam_params": {"learning_rate": 1e-3}})
    assert step.status_code == 200, step.text
    assert "metrics" in alice.result(step.json()["request_id"]).json()
    assert served_forward_backward(alice, model_id, 4) > 0
    assert server.proc.poll() is None, server.logs()

def test_a_model_id_belongs_to_one_tenant(server: ServerProcess) -> None:
    alice, bob = Api(server, KEYS["alice"]), Api(server, KEYS["bob"])
    session, model_id = new_model(alice)
    body: dict[str, Any] = {"model_seq_id": 0, "base_model": MODEL_NAME, "lora_config": {"rank": 4}}
    # No session, or another tenant's: refused at once, so no two tenants share a model id.
    r = bob.post("/create_model", {**body, "session_id": ""})
    assert r.status_code == 400 and "session_id" in r.json()["detail"], r.text
    r = alice.post("/create_model", {**body, "session_id": ""})
    assert r.status_code == 400 and "session_id" in r.json()["detail"], r.text
    r = bob.post("/create_model", {**body, "session_id": session})
    assert r.status_code == 404 and "session_id" in r.json()["detail"], r.text
    # Alice's model is still hers, and bob cannot see it.
    assert served_forward_backward(alice, model_id, 1) > 0
    r = bob.post("/forward_backward", data=fwdbwd_body(model_id, 1), headers=PROTO)
    assert r.status_code == 404, r.text

# ---- sampling sessions and snapshots are released ----------------------------------------

def gauges(server: ServerProcess) -> tuple[int, int]:
    """(twinkle_sampler_sessions, twinkle_sampler_snapshots) from /metrics."""
    samples = prom.parse(requests.get(server.http_url("/metrics"), timeout=10).text)
    return int(prom.value(samples, "twinkle_sampler_sessions")), int(prom.value(samples, "twinkle_sampler_snapshots"))


def capacity(server: ServerProcess) -> Any:
    c = Client(server.grpc_address, KEYS["alice"])
    try:
        return c.utility.GetCapacity(upb.GetCapacityRequest(), metadata=c.metadata, timeout=10)
    finally:
        c.close()


RL_STEPS = 300
PER_TENANT = 4  # sampler.max_snapshots_per_tenant in this test


def test_an_rl_loop_that_never_closes_anything_runs_in_a_bounded_footprint(launch_server: LaunchServer,
                                                                            tmp_path: Path) -> None:
    import tinker
    from tinker import types

    server = launch_server(auth_overrides(storage={"data_dir": str(tmp_path / "data")},
                                          sampler={"max_snapshots_per_tenant": PER_TENANT}))
    base = f"http://{server.host}:{server.http_port}"
    svc = tinker.ServiceClient(base_url=base, api_key=KEYS["alice"])
    made = svc.create_lora_training_client(base_model=MODEL_NAME, rank=4)
    training = resolved(made)
    prompt = types.ModelInput.from_ints([11, 42, 7])
    params = types.SamplingParams(max_tokens=2, temperature=1.0, seed=3)
    first_sampler = None
    most_sessions = most_snapshots = 0
    for step in range(RL_STEPS):
        made = training.save_weights_and_get_sampling_client()
        sampler = resolved(made)
        first_sampler = first_sampler or sampler
        out = sampler.sample(prompt, num_samples=1, sampling_params=params).result()
        tokens = [11, 42, 7] + list(out.sequences[0].tokens)
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
        if step % 25 == 0 or step == RL_STEPS - 1:
            sessions, snapshots = gauges(server)
            most_sessions, most_snapshots = max(most_sessions, sessions), max(most_snapshots, snapshots)
    print(f"after {RL_STEPS} steps: at most {most_sessions} sampling sessions, {most_snapshots} snapshots "
          f"(per-tenant cap {PER_TENANT})")
    assert most_snapshots <= PER_TENANT and most_sessions <= PER_TENANT
    assert capacity(server).sampler_snapshots <= PER_TENANT
    # The other tenant is served normally.
    bob = Api(server, KEYS["bob"])
    assert served_forward_backward(bob, new_model(bob)[1], 1) > 0

    # The first sampler's snapshot was evicted long ago: using it is a clear error, not a
    # sample from other weights.
    with pytest.raises(tinker.APIStatusError) as info:
        first_sampler.sample(prompt, num_samples=1, sampling_params=params).result()
    assert info.value.status_code == 403 and "was released" in str(info.value), str(info.value)

    # Session-less sampling reuses one implicit session per (tenant, model path).
    alice = Api(server, KEYS["alice"])
    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [11, 42, 7]}]}, "num_samples": 1,
            "sampling_params": {"max_tokens": 2, "seed": 1}}
    before, _ = gauges(server)
    for _ in range(80):  # more than sampler.max_sessions_per_tenant (64)
        r = alice.post("/asample", body)
        assert r.status_code == 200, r.text
    assert "sequences" in alice.result(r.json()["request_id"]).json()
    after, _ = gauges(server)
    assert after <= before + 1, (before, after)

    # Closing the ServiceClient finishes its session: its sampling sessions and snapshots go.
    svc.close("success").result()
    wait_until(lambda: gauges(server)[1] == 0 or None, scaled(10), "the session's snapshots released")
    assert capacity(server).sampler_snapshots == 0
    assert server.proc.poll() is None, server.logs()


# ---- seq_id gaps -------------------------------------------------------------------------

GAP_S = 30.0  # TinkerOptions::seq_gap_timeout


def fwdbwd_tokens(model_id: str, seq_id: int, n: int) -> bytes:
    """A forward_backward of one datum of n tokens."""
    rng = np.random.default_rng(seq_id)
    seq = rng.integers(0, 200, n + 1)
    datum = tp.Datum(
        model_input=[tp.Chunk(encoded_text=tp.EncodedTextChunk(tokens=np.asarray(seq[:-1], np.int32).tobytes()))],
        loss_fn_inputs={"target_tokens": tp.Tensor(dense=np.asarray(seq[1:], np.int64).tobytes(),
                                                   dtype=tp.DTYPE_INT64, shape=[n])})
    return tp.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, data=[datum],
                                     loss_fn="cross_entropy").SerializeToString()


def outcome(api: Api, request_id: str, deadline: float) -> dict[str, Any]:
    """The future's JSON result, long-polling until `deadline` (time.monotonic())."""
    while time.monotonic() < deadline:
        r = api.post("/retrieve_future", {"request_id": request_id})
        assert r.status_code == 200, r.text
        if r.json().get("type") != "try_again":
            return r.json()
    raise AssertionError(f"{request_id} still pending")


@pytest.fixture
def gap_server(launch_server: LaunchServer, tmp_path: Path) -> ServerProcess:
    overrides = auth_overrides(storage={"data_dir": str(tmp_path / "data")})
    for tenant in overrides["auth"]["tenants"]:
        if tenant["id"] == "bob":
            tenant["quotas"] = {"max_pending_ops": 3}
    overrides["limits"] = {"max_buffered_tokens": 63, "max_pending_ops": 16}
    return launch_server(overrides)


def test_each_seq_gap_is_timed_on_its_own_and_buffered_ops_count_against_limits(gap_server: ServerProcess) -> None:
    server = gap_server
    alice, bob = Api(server, KEYS["alice"]), Api(server, KEYS["bob"])
    _, model_id = new_model(alice)
    _, bob_model = new_model(bob)

    # seq 2, 3, 5, 6 without 1 and 4: two gaps, each timed from its own first op's arrival.
    start = time.monotonic()
    ids = {}
    for seq in (2, 3, 5, 6):
        r = alice.post("/forward_backward", data=fwdbwd_tokens(model_id, seq, 7), headers=PROTO)
        assert r.status_code == 200, r.text
        ids[seq] = r.json()["request_id"]
    deadline = start + scaled(2 * GAP_S)
    for seq, request_id in ids.items():
        out = outcome(alice, request_id, deadline)
        assert "metrics" in out, (seq, out)
    print(f"seq 2,3,5,6 without 1 and 4: all finished after {time.monotonic() - start:.1f} s "
          f"(gap timeout {GAP_S:.0f} s)")

    # Ops ahead of a gap are admitted like queued ones. Oversized: refused at once (403),
    # nothing buffered, so the coordinator's memory stays flat.
    proc = psutil.Process(server.pid)
    rss_before = proc.memory_info().rss
    oversized = fwdbwd_tokens(model_id, 1000, 40000)
    for i in range(300):
        body = oversized if i == 0 else tp.ForwardBackwardRequest.FromString(oversized)
        if i > 0:
            body.seq_id = 1000 + i
            body = body.SerializeToString()
        r = alice.post("/forward_backward", data=body, headers=PROTO)
        assert r.status_code == 403, r.text
        assert "max_tokens_per_request" in r.json()["detail"], r.text
    growth = proc.memory_info().rss - rss_before
    print(f"300 far-ahead oversized ops: all 403; coordinator RSS growth {growth / 2**20:.1f} MiB")
    assert growth < 100 * 2**20

    # Buffered tokens: 9 ops of 7 tokens fill max_buffered_tokens (63); the 10th is refused
    # (429, it clears when the gap fills or times out), naming the limit.
    for i in range(9):
        r = alice.post("/forward_backward", data=fwdbwd_tokens(model_id, 2000 + i, 7), headers=PROTO)
        assert r.status_code == 200, r.text
    r = alice.post("/forward_backward", data=fwdbwd_tokens(model_id, 2009, 7), headers=PROTO)
    assert r.status_code == 429 and "max_buffered_tokens" in r.json()["detail"], r.text

    # Buffered ops count toward max_pending_ops (bob's quota: 3): the 4th is refused.
    for i in range(3):
        r = bob.post("/forward_backward", data=fwdbwd_tokens(bob_model, 100 + i, 7), headers=PROTO)
        assert r.status_code == 200, r.text
    r = bob.post("/forward_backward", data=fwdbwd_tokens(bob_model, 103, 7), headers=PROTO)
    assert r.status_code == 429 and "max_pending_ops" in r.json()["detail"], r.text

    # The other tenant is served normally meanwhile: alice's in-order op of another model.
    _, other = new_model(alice)
    assert served_forward_backward(alice, other, 1) > 0
    assert server.proc.poll() is None, server.logs()


# ---- sampling is rate-limited like training ----------------------------------------------

def test_sampling_is_charged_to_the_tenants_token_rate_like_training(launch_server: LaunchServer,
                                                                     tmp_path: Path) -> None:
    overrides = auth_overrides(storage={"data_dir": str(tmp_path / "data")})
    for tenant in overrides["auth"]["tenants"]:
        if tenant["id"] == "alice":
            tenant["quotas"] = {"tokens_per_s": 0.01, "burst_tokens": 40}
    server = launch_server(overrides)
    alice, bob = Api(server, KEYS["alice"]), Api(server, KEYS["bob"])
    _, model_id = new_model(alice)
    # (3 prompt + 7 new tokens) x 4 samples = 40 tokens: exactly alice's burst.
    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": [11, 42, 7]}]}, "num_samples": 4,
            "sampling_params": {"max_tokens": 7, "seed": 1}}
    first = alice.post("/asample", body)
    assert first.status_code == 200, first.text
    assert len(alice.result(first.json()["request_id"]).json()["sequences"]) == 4
    refused = alice.post("/asample", body)
    assert refused.status_code == 429, refused.text
    assert int(refused.headers["Retry-After"]) >= 1
    # The same bucket as training: alice's forward_backward waits too...
    r = alice.post("/forward_backward", data=fwdbwd_body(model_id, 1), headers=PROTO)
    assert r.status_code == 429, r.text
    # ...while bob, without a rate quota, samples and trains as usual.
    for _ in range(3):
        ok = bob.post("/asample", body)
        assert ok.status_code == 200, ok.text
    _, bob_model = new_model(bob)
    assert served_forward_backward(bob, bob_model, 1) > 0


# ---- session finish --------------------------------------------------------------------------

def figures(server: ServerProcess) -> tuple[int, int, int, int]:
    """(GetCapacity used_adapters, its sampler_snapshots, /metrics sampler sessions, snapshots)."""
    cap = capacity(server)
    sessions, snapshots = gauges(server)
    return cap.used_adapters, cap.sampler_snapshots, sessions, snapshots


def test_finishing_a_session_restores_the_figures_within_a_second(server: ServerProcess) -> None:
    alice, bob = Api(server, KEYS["alice"]), Api(server, KEYS["bob"])
    _, bob_model = new_model(bob)  # bob's model stays through alice's finish
    before = figures(server)
    session, model_id = new_model(alice)
    assert served_forward_backward(alice, model_id, 1) > 0
    snap = alice.post("/save_weights_for_sampler", {"model_id": model_id, "seq_id": 2})
    assert snap.status_code == 200, snap.text
    assert "sampling_session_id" in alice.result(snap.json()["request_id"]).json()
    during = figures(server)
    assert during[0] == before[0] + 1 and during[1] == before[1] + 1, (before, during)

    r = alice.post(f"/sessions/{session}/finish")
    assert r.status_code == 200, r.text
    finished_at = time.monotonic()
    wait_until(lambda: figures(server) == before or None, 1.0, f"figures back to {before} after finish")
    print(f"figures back to {before} {time.monotonic() - finished_at:.3f} s after finish")
    # The SDK stops heartbeating on 410; an unknown session stays 404.
    r = alice.post("/session_heartbeat", {"session_id": session})
    assert r.status_code == 410, r.text
    assert alice.post("/session_heartbeat", {"session_id": "no-such-session"}).status_code == 404
    # Bob's model is untouched.
    assert served_forward_backward(bob, bob_model, 1) > 0


# ---- sessions per tenant -------------------------------------------------------------------

def test_sessions_are_bounded_per_tenant_over_both_apis(launch_server: LaunchServer, tmp_path: Path) -> None:
    overrides = auth_overrides(storage={"data_dir": str(tmp_path / "data")})
    for tenant in overrides["auth"]["tenants"]:
        if tenant["id"] == "bob":
            tenant["quotas"] = {"max_sessions": 2}
    server = launch_server(overrides)
    alice, bob = Api(server, KEYS["alice"]), Api(server, KEYS["bob"])
    bob_grpc = Client(server.grpc_address, KEYS["bob"])
    try:
        # One Tinker session and one Twinkle session fill bob's two...
        first = bob.post("/create_session", {"tags": []})
        assert first.status_code == 200, first.text
        bob_grpc.training.CreateSession(tpb.CreateSessionRequest(), metadata=bob_grpc.metadata, timeout=10)
        # ...so the third, over either API, is refused naming the limit (403: not retryable).
        r = bob.post("/create_session", {"tags": []})
        assert r.status_code == 403 and "max_sessions" in r.json()["detail"], r.text
        assert r.headers["x-should-retry"] == "false"
        with pytest.raises(grpc.RpcError) as err:
            bob_grpc.training.CreateSession(tpb.CreateSessionRequest(), metadata=bob_grpc.metadata, timeout=10)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "max_sessions" in (err.value.details() or "")
        # alice (default quota) is served meanwhile, and bob gets room back by finishing one.
        for _ in range(3):
            assert alice.post("/create_session", {"tags": []}).status_code == 200
        # (finish ends the session on the blocking thread: a create may see it a moment later)
        assert bob.post(f"/sessions/{first.json()['session_id']}/finish").status_code == 200
        wait_until(lambda: bob.post("/create_session", {"tags": []}).status_code == 200 or None, 2.0,
                   "a session created after finishing one")
    finally:
        bob_grpc.close()
