"""Requests that used to hang or crash-loop the engine link (issue 15, "IPC of any size"),
driven as a hostile or merely busy tenant would, with auth on and two tenants.

Before: a 1024-datum importance_sampling chunk (the SDK's own chunk size), 1400 one-token
datums, or a 2 MB loss_fn_config made a message over the link's frame/envelope limits; the
engine dropped it without a reply and training hung for every tenant. 16 prompts x 128
samples made a reply over them; the supervisor killed the engine, replayed, and looped.
Now each goes through (or fails alone, at once, with an error that says why), the other
tenant's ordinary request completes, and no worker restarts.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import requests

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "1")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from e2e_support import prom  # noqa: E402
from e2e_support.server import LaunchServer, ServerProcess  # noqa: E402
from e2e_support.training import Client, KEYS, auth_overrides, batch, resolved, state_dict  # noqa: E402
from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb  # noqa: E402
from twinkle_client._proto.twinkle.v1 import training_pb2_grpc as tgrpc  # noqa: E402
from twinkle_client._proto.twinkle.v1 import utility_pb2 as upb  # noqa: E402

MODEL_NAME = "tiny-qwen3"
OTHER_TENANT_BUDGET_S = 30.0


def service(server: ServerProcess, key: str) -> tinker.ServiceClient:
    return tinker.ServiceClient(base_url=f"http://{server.host}:{server.http_port}", api_key=key)


def training_client(server: ServerProcess, key: str) -> Any:
    made = service(server, key).create_lora_training_client(base_model=MODEL_NAME, rank=4)
    return resolved(made)


def worker_restarts(server: ServerProcess) -> list[int]:
    c = Client(server.grpc_address, KEYS["alice"])
    try:
        return [d.restarts for d in c.utility.GetServerInfo(upb.GetServerInfoRequest(), metadata=c.metadata,
                                                               timeout=10).devices]
    finally:
        c.close()


def ce_datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def is_datum(rng: np.random.Generator, length: int = 3) -> types.Datum:
    tokens = rng.integers(1, 500, size=length + 1).tolist()
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:],
                        "logprobs": rng.uniform(-8.0, -4.0, size=length).astype(np.float32).tolist(),
                        "advantages": rng.normal(size=length).astype(np.float32).tolist()})


def other_tenant_is_served(bob: Any) -> float:
    """Bob's ordinary forward_backward + optim_step; returns how long it took."""
    start = time.monotonic()
    fb = bob.forward_backward([ce_datum([5, 17, 42, 9, 77])], "cross_entropy")
    bob.optim_step(types.AdamParams(learning_rate=1e-3))
    out = fb.result(timeout=OTHER_TENANT_BUDGET_S)
    assert math.isfinite(out.metrics["loss:sum"])
    return time.monotonic() - start


@pytest.fixture
def server(launch_server: LaunchServer) -> ServerProcess:
    return launch_server(auth_overrides())


def test_a_1024_datum_importance_sampling_chunk_equals_the_same_datums_in_small_chunks(
        server: ServerProcess) -> None:
    alice = training_client(server, KEYS["alice"])
    bob = training_client(server, KEYS["bob"])
    rng = np.random.default_rng(0)
    data = [is_datum(rng) for _ in range(1024)]
    big = alice.forward_backward(data, "importance_sampling")
    took = other_tenant_is_served(bob)
    out = big.result(timeout=300)
    assert len(out.loss_fn_outputs) == 1024
    # The same datums in 16 forward-only calls of 64 (same weights: no optim_step between)
    # give the same per-datum log-probs and, summed, the same loss.
    small_loss = 0.0
    small_logprobs: list[np.ndarray] = []
    for i in range(0, 1024, 64):
        part = alice.forward(data[i:i + 64], "importance_sampling").result(timeout=120)
        small_loss += part.metrics["loss:sum"]
        small_logprobs += [np.asarray(o["logprobs"].tolist()) for o in part.loss_fn_outputs]
    big_logprobs = [np.asarray(o["logprobs"].tolist()) for o in out.loss_fn_outputs]
    worst = max(float(np.max(np.abs(a - b))) for a, b in zip(big_logprobs, small_logprobs))
    print(f"1024-datum chunk: loss {out.metrics['loss:sum']:.6f} vs 16x64 {small_loss:.6f}, "
          f"max |dlogprob| {worst:.2e}; bob served in {took:.2f} s")
    assert worst <= 1e-5
    assert out.metrics["loss:sum"] == pytest.approx(small_loss, rel=1e-5, abs=1e-4)
    assert worker_restarts(server) == [0]


def test_1400_one_token_datums_train_and_the_other_tenant_is_served(server: ServerProcess) -> None:
    alice = training_client(server, KEYS["alice"])
    bob = training_client(server, KEYS["bob"])
    rng = np.random.default_rng(1)
    data = [ce_datum(rng.integers(1, 500, size=2).tolist()) for _ in range(1400)]
    big = alice.forward_backward(data, "cross_entropy")
    took = other_tenant_is_served(bob)
    out = big.result(timeout=300)
    assert len(out.loss_fn_outputs) == 1400
    # cross_entropy is the plain sum of -logprob over the weighted tokens (one per datum).
    by_formula = -sum(float(o["logprobs"].tolist()[0]) for o in out.loss_fn_outputs)
    assert out.metrics["loss:sum"] == pytest.approx(by_formula, rel=1e-5)
    print(f"1400 one-token datums: loss {out.metrics['loss:sum']:.4f}; bob served in {took:.2f} s")
    assert worker_restarts(server) == [0]


def test_a_2_mb_loss_fn_config_fails_alone_and_fast(server: ServerProcess) -> None:
    alice = training_client(server, KEYS["alice"])
    bob = training_client(server, KEYS["bob"])
    base = f"http://{server.host}:{server.http_port}/api/v1"
    headers = {"X-API-Key": KEYS["alice"]}
    body = {
        "model_id": alice.model_id, "seq_id": 1,  # the SDK has sent nothing since create_model
        "forward_backward_input": {
            "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [5, 17, 42]}]},
                      "loss_fn_inputs": {"target_tokens": {"data": [17, 42, 9], "dtype": "int64", "shape": [3]}}}],
            "loss_fn": "cross_entropy",
            "loss_fn_config": {"clip": "x" * (2 << 20)},
        },
    }
    start = time.monotonic()
    r = requests.post(base + "/forward_backward", json=body, headers=headers, timeout=60)
    if r.status_code == 200:  # accepted as a future: its result must be the error
        request_id = r.json()["request_id"]
        while True:
            r = requests.post(base + "/retrieve_future", json={"request_id": request_id}, headers=headers,
                              timeout=60)
            if not (r.status_code == 200 and r.json().get("type") == "try_again"):
                break
    took = time.monotonic() - start
    print(f"2 MB loss_fn_config: {r.status_code} {r.text[:200]} in {took:.2f} s")
    assert 400 <= r.status_code < 500, r.text[:300]
    assert "loss_fn_config" in r.text
    assert took < 10
    other_tenant_is_served(bob)
    assert worker_restarts(server) == [0]


def test_16_prompts_of_128_samples_come_back_without_restarting_the_engine(server: ServerProcess) -> None:
    alice = training_client(server, KEYS["alice"])
    bob = training_client(server, KEYS["bob"])
    sampler = alice.save_weights_and_get_sampling_client()
    sampler = resolved(sampler)
    params = types.SamplingParams(max_tokens=10, temperature=1.0, seed=3)
    futures = [sampler.sample(types.ModelInput.from_ints([5 + p, 17, 42]), num_samples=128,
                              sampling_params=params) for p in range(16)]
    took = other_tenant_is_served(bob)
    results = [f.result(timeout=600) for f in futures]
    assert [len(r.sequences) for r in results] == [128] * 16
    assert all(1 <= len(s.tokens) <= 10 for r in results for s in r.sequences)
    print(f"16 x 128 samples: {sum(len(s.tokens) for r in results for s in r.sequences)} tokens; "
          f"bob served in {took:.2f} s")
    assert worker_restarts(server) == [0]


# ---- transports: exposure, amplification, shutdown -------------------------------------------

def test_reflection_does_not_answer_without_a_key_when_auth_is_on(server: ServerProcess) -> None:
    import grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    channel = grpc.insecure_channel(server.grpc_address)
    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as err:
            list(stub.ServerReflectionInfo(iter([request]), timeout=10))
    finally:
        channel.close()
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, err.value


def test_a_large_body_without_a_key_is_refused_before_it_is_read(server: ServerProcess) -> None:
    """The header says 60 MiB; only 1 KiB follows. The 401 comes at once, not after the body
    (or the 120 s idle timeout), and the connection is closed."""
    import socket

    declared = 60 << 20
    with socket.create_connection((server.host, server.http_port), timeout=10) as sock:
        start = time.monotonic()
        sock.sendall((f"POST /api/v1/forward_backward HTTP/1.1\r\nHost: {server.host}\r\n"
                      f"Content-Type: application/json\r\nContent-Length: {declared}\r\n\r\n").encode()
                     + b"x" * 1024)
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        took = time.monotonic() - start
    status_line = reply.split(b"\r\n", 1)[0].decode()
    print(f"60 MiB body without a key: {status_line!r} after {took * 1000:.0f} ms")
    assert status_line.startswith("HTTP/1.1 401"), reply[:300]
    assert took < 5
    # With a key the route still works (the check only refuses).
    bob = training_client(server, KEYS["bob"])
    other_tenant_is_served(bob)


def test_json_nested_300k_deep_is_refused_and_the_server_stays_up(server: ServerProcess) -> None:
    base = f"http://{server.host}:{server.http_port}/api/v1"
    headers = {"X-API-Key": KEYS["alice"], "Content-Type": "application/json"}
    depth = 300_000
    for route, body in (("/create_model", '{"session_id": "s", "base_model": "tiny-qwen3", "lora_config": '
                                          + "[" * depth + "]" * depth + "}"),
                        ("/asample", '{"sampling_params": ' + "{\"a\":" * depth + "1" + "}" * depth + "}")):
        start = time.monotonic()
        r = requests.post(base + route, data=body, headers=headers, timeout=30)
        took = time.monotonic() - start
        print(f"{route} nested {depth} deep: {r.status_code} {r.text[:120]} in {took * 1000:.0f} ms")
        assert r.status_code == 400, r.text[:300]
        assert "nested deeper than 64" in r.text
        assert took < 5
    assert server.proc.poll() is None, server.logs()
    other_tenant_is_served(training_client(server, KEYS["bob"]))


def test_sparse_tensors_that_would_densify_to_gigabytes_are_refused_before_allocation(
        server: ServerProcess) -> None:
    import psutil
    from twinkle_client._proto.tinker.v1 import tinker_public_pb2 as tp

    alice = training_client(server, KEYS["alice"])
    base = f"http://{server.host}:{server.http_port}/api/v1"
    headers = {"X-API-Key": KEYS["alice"], "Content-Type": "application/x-protobuf"}
    tokens = [5, 17, 42]
    # 2^26 columns, one stored value: 132 bytes on the wire, 512 MiB of doubles once dense.
    sparse = tp.Tensor(dtype=tp.DTYPE_FLOAT32, shape=[1, 1 << 26],
                       sparse_csr=tp.SparseCsr(crow_indices=np.asarray([0, 1], np.int64).tobytes(),
                                               col_indices=np.asarray([0], np.int64).tobytes(),
                                               values=np.asarray([1.0], np.float32).tobytes()))
    datum = tp.Datum(
        model_input=[tp.Chunk(encoded_text=tp.EncodedTextChunk(tokens=np.asarray(tokens, np.int32).tobytes()))],
        loss_fn_inputs={"target_tokens": tp.Tensor(dense=np.asarray([17, 42, 9], np.int64).tobytes(),
                                                   dtype=tp.DTYPE_INT64, shape=[3]),
                        "weights": sparse})
    body = tp.ForwardBackwardRequest(model_id=alice.model_id, data=[datum],
                                     loss_fn="cross_entropy").SerializeToString()
    rss_before = psutil.Process(server.pid).memory_info().rss
    start = time.monotonic()
    for _ in range(500):
        r = requests.post(base + "/forward_backward", data=body, headers=headers, timeout=30)
        assert r.status_code == 400, r.text[:300]
    took = time.monotonic() - start
    growth = psutil.Process(server.pid).memory_info().rss - rss_before
    print(f"500 sparse [1, 2^26] datums: 400 each, {took / 500 * 1000:.1f} ms per request, "
          f"RSS growth {growth / 2**20:.1f} MiB; {r.text[:160]}")
    assert "loss_fn_inputs.weights" in r.text and "67108864" in r.text
    assert growth < 100 << 20
    other_tenant_is_served(training_client(server, KEYS["bob"]))


@pytest.mark.parametrize("attempt", range(5))
def test_sigterm_with_an_open_keep_alive_connection_and_a_long_poll_exits_0(
        launch_server: LaunchServer, attempt: int) -> None:
    """The SDK keeps its connection open and long-polls retrieve_future; SIGTERM must still
    end the process cleanly (exit 0) every time, not segfault after "stopped cleanly"."""
    server = launch_server(auth_overrides())
    alice = training_client(server, KEYS["alice"])
    session = requests.Session()  # keep-alive
    base = f"http://{server.host}:{server.http_port}/api/v1"
    headers = {"X-API-Key": KEYS["alice"]}
    assert session.get(base + "/healthz", timeout=10).status_code == 200
    # A long-poll that is still waiting when the signal comes: the future of a forward_backward
    # queued behind a large one, so it cannot finish within the moment before the signal.
    rng = np.random.default_rng(attempt)
    alice.forward_backward([ce_datum(rng.integers(1, 500, size=64).tolist()) for _ in range(64)], "cross_entropy")
    queued = session.post(base + "/forward_backward", headers=headers, timeout=30, json={
        "model_id": alice.model_id, "seq_id": 2,  # after the SDK's (seq 1)
        "forward_backward_input": {
            "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [5, 17, 42]}]},
                      "loss_fn_inputs": {"target_tokens": {"data": [17, 42, 9], "dtype": "int64", "shape": [3]}}}],
            "loss_fn": "cross_entropy"}})
    assert queued.status_code == 200, queued.text
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    pending = pool.submit(session.post, base + "/retrieve_future",
                          json={"request_id": queued.json()["request_id"]}, headers=headers, timeout=30)
    time.sleep(0.3)
    server.send_signal(__import__("signal").SIGTERM)
    code = server.wait_exit(60)
    pool.shutdown(wait=True)
    del pending
    assert code == 0, server.logs()
    assert "stopped cleanly" in server.stderr_text()


def test_host_and_origin_guard_dns_rebinding_and_browser_posts(server: ServerProcess) -> None:
    base = f"http://{server.host}:{server.http_port}"
    key = {"X-API-Key": KEYS["alice"]}
    # DNS rebinding: the attacker's name resolves to 127.0.0.1; the browser sends it as Host.
    r = requests.get(base + "/api/v1/get_server_capabilities", headers={**key, "Host": "evil.example:8000"},
                     timeout=10)
    assert r.status_code == 403 and "server.allowed_hosts" in r.text, r.text
    r = requests.get(base + "/metrics", headers={"Host": "evil.example"}, timeout=10)
    assert r.status_code == 403, r.text
    # A page the user visits POSTs to the loopback API.
    r = requests.post(base + "/api/v1/create_session", json={}, headers={**key, "Origin": "https://evil.example"},
                      timeout=10)
    assert r.status_code == 403 and "server.allowed_origins" in r.text, r.text
    # The SDKs send neither: served.
    assert requests.get(base + "/api/v1/get_server_capabilities", headers=key, timeout=10).status_code == 200
    assert requests.get(base + "/api/v1/get_server_capabilities",
                        headers={**key, "Host": f"localhost:{server.http_port}"}, timeout=10).status_code == 200


def test_metrics_do_not_name_tenants_with_auth_on_unless_configured(launch_server: LaunchServer) -> None:
    from e2e_support import prom

    def depth_labels(server: ServerProcess) -> set[str]:
        alice = training_client(server, KEYS["alice"])
        other_tenant_is_served(alice)
        text = requests.get(server.http_url("/metrics"), timeout=10).text
        samples = prom.parse(text)
        return {s.labels["tenant"] for s in samples if "tenant" in s.labels}

    hidden = launch_server(auth_overrides())
    labels = depth_labels(hidden)
    assert labels == {"all"}, labels
    assert "alice" not in requests.get(hidden.http_url("/metrics"), timeout=10).text
    shown = launch_server(auth_overrides(server={"metrics_tenant_labels": True}))
    assert {"alice", "bob"} <= depth_labels(shown)


def test_connections_over_the_limit_get_503_and_the_rest_are_served(launch_server: LaunchServer) -> None:
    import socket

    limit = 8
    server = launch_server(auth_overrides(server={"max_http_connections": limit}))
    held = [socket.create_connection((server.host, server.http_port), timeout=10) for _ in range(limit)]
    try:
        time.sleep(0.2)  # let the server accept them all
        with socket.create_connection((server.host, server.http_port), timeout=10) as extra:
            reply = extra.recv(4096)
        assert reply.startswith(b"HTTP/1.1 503"), reply[:200]
        assert b"server.max_http_connections" in reply
    finally:
        for s in held:
            s.close()
    # Once they are closed, requests are served again.
    from e2e_support.waiting import wait_until
    wait_until(lambda: requests.get(server.http_url("/healthz"), timeout=5).status_code == 200, 10,
               "a request served after the held connections closed")


def test_blocking_handlers_leave_the_probes_and_other_connections_answering(
        launch_server: LaunchServer) -> None:
    """Ten handlers that block their threads for 3 s (the stand-in for a slow checkpoint read
    or SQLite call) — more than the HTTP I/O threads and the handler pool together: /healthz
    and /readyz still answer at once."""
    server = launch_server(auth_overrides(testing={"hooks": True}))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=10)
    blocked = [pool.submit(requests.post, server.http_url("/testing/block?ms=3000"), timeout=30) for _ in range(10)]
    time.sleep(0.3)
    worst = 0.0
    for path in ("/healthz", "/readyz", "/api/v1/healthz") * 3:
        start = time.monotonic()
        assert requests.get(server.http_url(path), timeout=10).status_code == 200
        worst = max(worst, time.monotonic() - start)
    assert all(not f.done() for f in blocked[:8]), "the blocking handlers should still be running"
    print(f"probes while 10 handlers block: worst {worst * 1000:.0f} ms")
    assert worst < 1.0
    assert all(f.result().status_code == 200 for f in blocked)
    pool.shutdown()


def test_each_body_bound_holds_at_its_limit_and_refuses_one_past(server: ServerProcess) -> None:
    from twinkle_client._proto.tinker.v1 import tinker_public_pb2 as tp

    alice = training_client(server, KEYS["alice"])
    base = f"http://{server.host}:{server.http_port}/api/v1"
    json_headers = {"X-API-Key": KEYS["alice"], "Content-Type": "application/json"}

    # JSON depth: 64 levels parse (the route then answers about the content), 65 do not.
    def nested(depth: int) -> str:
        return '{"session_id": "s", "base_model": "tiny-qwen3", "x": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}"

    at = requests.post(base + "/create_model", data=nested(64), headers=json_headers, timeout=30)
    past = requests.post(base + "/create_model", data=nested(65), headers=json_headers, timeout=30)
    assert "nested deeper" not in at.text, at.text
    assert past.status_code == 400 and "nested deeper than 64" in past.text, past.text

    # loss_fn_config strings: 256 bytes reach the loss (which names the unknown key), 257 do not.
    def fb(value: str, seq_id: int) -> requests.Response:
        return requests.post(base + "/forward_backward", headers=json_headers, timeout=30, json={
            "model_id": alice.model_id, "seq_id": seq_id,
            "forward_backward_input": {
                "data": [{"model_input": {"chunks": [{"type": "encoded_text", "tokens": [5, 17, 42]}]},
                          "loss_fn_inputs": {"target_tokens": {"data": [17, 42, 9], "dtype": "int64",
                                                               "shape": [3]}}}],
                "loss_fn": "cross_entropy", "loss_fn_config": {"clip": value}}})

    at = fb("x" * 256, 1)
    assert at.status_code == 200, at.text
    while True:
        result = requests.post(base + "/retrieve_future", json={"request_id": at.json()["request_id"]},
                               headers=json_headers, timeout=60)
        if not (result.status_code == 200 and result.json().get("type") == "try_again"):
            break
    assert "unknown config key 'clip'" in result.text, result.text  # the loss saw it
    past = fb("x" * 257, 2)
    assert past.status_code == 400 and "exceeds the limit of 256" in past.text, past.text

    # A CSR loss_fn_input may hold kMaxTargetWidth (64) elements per model_input token (soft
    # targets [N, K]): 3 x 64 here.
    def sparse_body(cols: int) -> bytes:
        sparse = tp.Tensor(dtype=tp.DTYPE_FLOAT32, shape=[1, cols],
                           sparse_csr=tp.SparseCsr(crow_indices=np.asarray([0, 1], np.int64).tobytes(),
                                                   col_indices=np.asarray([0], np.int64).tobytes(),
                                                   values=np.asarray([1.0], np.float32).tobytes()))
        datum = tp.Datum(
            model_input=[tp.Chunk(encoded_text=tp.EncodedTextChunk(tokens=np.asarray([5, 17, 42], np.int32).tobytes()))],
            loss_fn_inputs={"target_tokens": tp.Tensor(dense=np.asarray([17, 42, 9], np.int64).tobytes(),
                                                       dtype=tp.DTYPE_INT64, shape=[3]), "weights": sparse})
        return tp.ForwardBackwardRequest(model_id=alice.model_id, data=[datum], loss_fn="cross_entropy").SerializeToString()

    proto_headers = {"X-API-Key": KEYS["alice"], "Content-Type": "application/x-protobuf"}
    past = requests.post(base + "/forward_backward", data=sparse_body(3 * 64 + 1), headers=proto_headers, timeout=30)
    assert past.status_code == 400 and "larger than the 192 elements" in past.text, past.text
    at = requests.post(base + "/forward_backward", data=sparse_body(3 * 64), headers=proto_headers, timeout=30)
    assert "larger than" not in at.text, at.text


def test_adapter_names_follow_the_checkpoint_name_rule(server: ServerProcess) -> None:
    import grpc
    from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb

    c = Client(server.grpc_address, KEYS["alice"])
    try:
        for bad in ("..", ".", ".hidden", "a/b", "x" * 129, "new\nline"):
            with pytest.raises(grpc.RpcError) as err:
                c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name=bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, err.value)
            assert "adapter_name" in err.value.details()
        c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name="x" * 128))  # at the limit
    finally:
        c.close()


def test_a_wait_future_asking_for_hours_answers_not_done_within_the_server_bound(
        launch_server: LaunchServer) -> None:
    """WaitFuture answers "not done" after at most 60 s whatever timeout_ms asks (a lost client's
    registration does not live for hours)."""
    from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb

    server = launch_server(auth_overrides(testing={"hooks": True}))
    c = Client(server.grpc_address, KEYS["alice"])
    try:
        c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name="w"))
        c.call("PauseScheduler", tpb.Empty())
        # No deadline on the op itself (a call's deadline becomes its op's): only WaitFuture's bound is tested.
        fid = c.call("Step", tpb.AdapterRequest(adapter_name="w", options=tpb.RequestOptions(return_future=True)),
                     timeout=None).future_id
        start = time.monotonic()
        reply = c.call("WaitFuture", tpb.WaitFutureRequest(future_id=fid, timeout_ms=3_600_000), timeout=300)
        took = time.monotonic() - start
        print(f"WaitFuture(timeout_ms=3600000) on a paused scheduler: done={reply.done} after {took:.1f} s")
        assert not reply.done
        assert 55 <= took < 120
        c.call("ResumeScheduler", tpb.Empty())
    finally:
        c.close()


def test_waiting_for_futures_holds_no_server_thread(launch_server: LaunchServer) -> None:
    """WaitFuture answers from the future's completion or a timer, never by blocking a gRPC
    thread: 400 waits outstanding on a paused scheduler's future (over 4 connections), and
    another tenant's calls are still answered while every one of them is still waiting."""
    from twinkle_client._proto.twinkle.v1 import training_pb2 as tpb

    server = launch_server(auth_overrides(testing={"hooks": True}))
    bob = Client(server.grpc_address, KEYS["bob"])
    # Each its own connection (Python gRPC shares one between equal channels otherwise, and a
    # connection carries at most server.max_concurrent_streams calls at once).
    waiters = [Client(server.grpc_address, KEYS["bob"]) for _ in range(4)]
    for w in waiters:
        w.channel.close()
        w.channel = grpc.insecure_channel(server.grpc_address, options=[("grpc.use_local_subchannel_pool", 1)])
        w.training = tgrpc.TrainingServiceStub(w.channel)
    alice = Client(server.grpc_address, KEYS["alice"])
    try:
        bob.call("AddAdapter", tpb.AddAdapterRequest(adapter_name="w"))
        bob.call("PauseScheduler", tpb.Empty())
        fid = bob.call("Step", tpb.AdapterRequest(adapter_name="w", options=tpb.RequestOptions(return_future=True)),
                       timeout=None).future_id
        waits = [w.training.WaitFuture.future(tpb.WaitFutureRequest(future_id=fid, timeout_ms=50_000),
                                              metadata=w.metadata, timeout=120)
                 for w in waiters for _ in range(100)]
        time.sleep(1.0)  # let them all reach the server
        # (calls that need no scheduler: it is paused)
        for _ in range(5):
            session = alice.call("CreateSession", tpb.CreateSessionRequest(), timeout=30).session_id
            alice.call("SessionHeartbeat", tpb.SessionHeartbeatRequest(session_id=session), timeout=30)
            alice.utility.GetCapacity(upb.GetCapacityRequest(), metadata=alice.metadata, timeout=30)
        assert not any(w.done() for w in waits), "a wait returned before its op could run"
        bob.call("ResumeScheduler", tpb.Empty())
        replies = [w.result() for w in waits]
        assert all(r.done for r in replies)
    finally:
        for c in (bob, alice, *waiters):
            c.close()


def make_deep_model(out: Path, tiny_model: Path, layers: int) -> Path:
    """A Qwen3 with `layers` narrow layers and the tiny model's tokenizer, saved locally."""
    import shutil

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True,
                         max_position_embeddings=256)
    Qwen3ForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for f in tiny_model.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "vocab.json", "merges.txt"):
            shutil.copy(f, out / f.name)
    return out


def test_the_full_adapter_state_of_an_80_layer_model_is_offloaded_reloaded_and_saved(
        launch_server: LaunchServer, tiny_model: Path, tmp_path: Path) -> None:
    """Every target of an 80-layer model with its AdamW state (80 x 7 x 2 LoRA matrices, their
    gradients and both moments: ~4,500 tensors) crosses the engine link whole: with one device
    slot, a second tenant's adapter forces it to host and back, and training afterwards equals
    training without the round trip; a save of it loads back."""
    deep = make_deep_model(tmp_path / "deep-80", tiny_model, layers=80)
    server = launch_server(auth_overrides(model={"path": str(deep), "name": "deep-80"}, scheduler={"max_loras": 1}))
    alice, bob = Client(server.grpc_address, KEYS["alice"]), Client(server.grpc_address, KEYS["bob"])
    vocab = json.loads((deep / "config.json").read_text())["vocab_size"]

    def add(c: Client, name: str) -> None:
        c.call("AddAdapter", tpb.AddAdapterRequest(adapter_name=name, config=tpb.LoraConfig(r=4, seed=7)))

    def step(c: Client, name: str, seed: int) -> float:
        loss = c.call("ForwardBackward", tpb.ForwardRequest(adapter_name=name, inputs=batch(seed, vocab))).result.loss
        c.call("ClipGradAndStep", tpb.ClipGradNormRequest(adapter_name=name, max_grad_norm=1.0))
        return loss

    add(alice, "ref")
    ref_losses = [step(alice, "ref", s) for s in range(3)]
    want = state_dict(alice, "ref")
    assert len(want) == 80 * 7 * 2
    alice.call("RemoveAdapter", tpb.AdapterRequest(adapter_name="ref"))

    add(alice, "a")
    losses = [step(alice, "a", s) for s in range(2)]
    add(bob, "b")
    step(bob, "b", 100)  # alice's adapter goes to host memory
    losses.append(step(alice, "a", 2))  # and comes back
    got = state_dict(alice, "a")
    worst = max(float(np.max(np.abs(got[k] - want[k]))) for k in want)
    print(f"80 layers, {len(want)} LoRA matrices: after offload + reload max |dw| = {worst:.3e}, "
          f"losses {losses} vs {ref_losses}")
    assert worst == 0.0 and losses == ref_losses
    saved = alice.call("Save", tpb.SaveRequest(adapter_name="a", name="deep", save_optimizer=True))
    alice.call("Load", tpb.LoadRequest(adapter_name="a", name=saved.twinkle_path, load_optimizer=True))
    samples = prom.parse(requests.get(server.http_url("/metrics"), timeout=10).text)
    assert prom.value(samples, "twinkle_adapter_events_total", event="offload") >= 2
    assert prom.value(samples, "twinkle_adapter_events_total", event="reload") >= 1
    assert worker_restarts(server) == [0]


def test_image_inputs_are_refused_with_a_clear_error_and_the_other_tenant_is_served(server: ServerProcess) -> None:
    """Vision is not supported yet (issue 16: text only, even for Qwen3.5's ConditionalGeneration
    checkpoints): an image chunk in forward_backward or sample is a 400 naming the chunk."""
    alice, bob = training_client(server, KEYS["alice"]), training_client(server, KEYS["bob"])
    image = types.ImageChunk(data=b"\x89PNG\r\n\x1a\n" + bytes(64), format="png", expected_tokens=4)
    datum = types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 17]), image]),
                        loss_fn_inputs={"target_tokens": [17, 42, 9, 77, 31, 8], "weights": [1.0] * 6})
    with pytest.raises(tinker.BadRequestError) as info:
        alice.forward_backward([datum], "cross_entropy").result()
    print(f"forward_backward with an image chunk: {info.value}")
    assert "chunks[1]" in str(info.value) and "only encoded_text chunks are supported" in str(info.value)
    sampler = alice.save_weights_and_get_sampling_client(name="img")
    with pytest.raises(tinker.BadRequestError) as info:
        sampler.sample(types.ModelInput(chunks=[image]), num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=2)).result()
    assert "only encoded_text chunks are supported" in str(info.value)
    assert other_tenant_is_served(bob) < OTHER_TENANT_BUDGET_S
    assert worker_restarts(server) == [0]
