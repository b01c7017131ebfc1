"""twinkle_client's transport against real gRPC (an in-process server with scripted services)
and a real HTTP discovery endpoint: typed errors, retries, endpoint discovery, run management."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

import twinkle_client
from fake_server import Failure, Script, default_script, start
from twinkle_client import RetryPolicy, TwinkleClient, init_twinkle_client
from twinkle_client._connection import resolve_endpoint
from twinkle_client.errors import (
    EndpointDiscoveryError,
    FailedPreconditionError,
    InvalidArgumentError,
    NotFoundError,
    ResourceExhaustedError,
    ServerError,
    UnavailableError,
)

KEY = "tml-alice-0123456789abcdef0123456789abcdef"


@pytest.fixture
def script() -> Iterator[Script]:
    yield default_script()


@pytest.fixture
def port(script: Script) -> Iterator[int]:
    server, bound = start(script)
    yield bound
    server.stop(grace=None)


class Sleeps(list):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


def connect(port: int, **kwargs) -> TwinkleClient:
    return TwinkleClient(f"grpc://127.0.0.1:{port}", KEY, session_heartbeat_interval=0, **kwargs)


def test_session_auth_and_run_management(port, script):
    with connect(port) as client:
        assert client.session_id.startswith("s")
        runs = client.list_training_runs()
        assert [r.training_run_id for r in runs] == ["s1-abc-default"]
        dumped = json.loads(runs[0].model_dump_json(indent=2))
        assert dumped["model_owner"] == "alice" and dumped["lora_rank"] == 8
        checkpoints = client.list_checkpoints(runs[0].training_run_id)
        assert checkpoints[0].twinkle_path == "twinkle://s1-abc-default/weights/a"
        assert json.loads(checkpoints[0].model_dump_json())["base_model"] == "tiny-qwen3"
        assert client.get_latest_checkpoint_path("s1-abc-default") == "twinkle://s1-abc-default/weights/a"
        assert client.get_checkpoint_path("s1-abc-default", "weights/a") == {
            "twinkle_path": "twinkle://s1-abc-default/weights/a"}
        assert client.delete_checkpoint("s1-abc-default", "weights/a") == {"success": True, "message": "deleted"}
        assert client.get_capacity_info() == {"max_loras": 8, "used_loras": 3, "free_loras": 5}
        assert client.get_server_capabilities()["supported_models"] == [{"model_name": "tiny-qwen3"}]
        assert [r.training_run_id for r in client.find_training_run_by_model("ms://tiny-qwen3")] == ["s1-abc-default"]
    for call in script.calls:
        assert call.metadata.get("authorization") == f"Bearer {KEY}"
    assert script.calls_to("DeleteCheckpoint")[0].request.checkpoint_id == "weights/a"


def test_errors_are_typed_with_code_and_message(port, script):
    script.fail("GetTrainingRun", Failure(grpc.StatusCode.NOT_FOUND, "no training run 'x'"))
    script.fail("DeleteCheckpoint", Failure(grpc.StatusCode.INVALID_ARGUMENT, "checkpoint_id: bad name"))
    with connect(port) as client:
        with pytest.raises(NotFoundError) as info:
            client.get_training_run("x")
        assert info.value.code == "NOT_FOUND" and info.value.message == "no training run 'x'"
        assert info.value.method == "GetTrainingRun" and isinstance(info.value, LookupError)
        assert str(info.value) == "GetTrainingRun: NOT_FOUND: no training run 'x'"
        with pytest.raises(ValueError):  # InvalidArgumentError is a ValueError too
            client.delete_checkpoint("r", "../x")


def test_unavailable_is_retried_with_backoff(port, script):
    sleeps = Sleeps()
    script.fail("GetCapacity", Failure(grpc.StatusCode.UNAVAILABLE, "server is shutting down"),
                Failure(grpc.StatusCode.UNAVAILABLE, "server is shutting down"))
    with connect(port, retry=RetryPolicy(initial_backoff_s=0.5, jitter=0.0)) as client:
        client.call.sleep = sleeps
        assert client.get_capacity_info()["free_loras"] == 5
    assert sleeps == [0.5, 1.0]
    assert len(script.calls_to("GetCapacity")) == 3


def test_rate_limits_wait_for_retry_after_and_quota_errors_are_final(port, script):
    sleeps = Sleeps()
    script.fail("GetCapacity", Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "rate limited", retry_after=3))
    script.fail("ListTrainingRuns", Failure(grpc.StatusCode.RESOURCE_EXHAUSTED, "quota max_pending_ops"))
    with connect(port, retry=RetryPolicy(jitter=0.0)) as client:
        client.call.sleep = sleeps
        assert client.get_capacity_info()["max_loras"] == 8
        assert sleeps == [3.0]
        with pytest.raises(ResourceExhaustedError) as info:
            client.list_training_runs()
        assert info.value.retry_after is None and info.value.attempts == 1
    assert len(script.calls_to("ListTrainingRuns")) == 1


def test_retries_give_up_after_max_attempts(port, script):
    script.fail("GetCapacity", *[Failure(grpc.StatusCode.UNAVAILABLE, "down")] * 5)
    with connect(port, retry=RetryPolicy(max_attempts=3, jitter=0.0)) as client:
        client.call.sleep = Sleeps()
        with pytest.raises(UnavailableError) as info:
            client.get_capacity_info()
    assert info.value.attempts == 3 and "after 3 attempts" in str(info.value)


def test_non_transient_errors_are_not_retried(port, script):
    script.fail("GetCapacity", Failure(grpc.StatusCode.FAILED_PRECONDITION, "no"))
    with connect(port) as client, pytest.raises(FailedPreconditionError):
        client.get_capacity_info()
    assert len(script.calls_to("GetCapacity")) == 1


def test_unreachable_server_fails_fast_with_unavailable():
    with socket_port() as free:
        with pytest.raises(UnavailableError):
            TwinkleClient(f"grpc://127.0.0.1:{free}", retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.01),
                          timeout=5)


def test_progress_is_reported_for_slow_calls(port, script):
    script.delay_s["GetCapacity"] = 0.35
    seen = []
    with connect(port, progress=lambda label, elapsed: seen.append((label, elapsed)), progress_interval=0.1) as client:
        assert client.get_capacity_info()["used_loras"] == 3
    assert seen and all(label == "GetCapacity" for label, _ in seen)
    assert [e for _, e in seen] == sorted(e for _, e in seen)


def test_heartbeats_are_sent(port, script):
    with TwinkleClient(f"grpc://127.0.0.1:{port}", KEY, session_heartbeat_interval=0.05) as client:
        deadline = threading.Event()
        deadline.wait(0.4)
        beats = script.calls_to("SessionHeartbeat")
        assert beats and beats[0].request.session_id == client.session_id


# ---- discovery over HTTP ------------------------------------------------------------------


class socket_port:
    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


def discovery_server(body: object, status: int = 200) -> tuple[ThreadingHTTPServer, list[dict[str, str]]]:
    seen: list[dict[str, str]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append({"path": self.path, "authorization": self.headers.get("Authorization", "")})
            payload = json.dumps(body).encode()
            self.send_response(status if self.path == "/api/v1/twinkle/endpoints" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, seen


def test_http_base_url_discovers_the_grpc_endpoint(port, script):
    http, seen = discovery_server({"grpc": f"0.0.0.0:{port}", "tls": False})
    try:
        base = f"http://127.0.0.1:{http.server_address[1]}"
        client = init_twinkle_client(base_url=base, api_key=KEY, session_heartbeat_interval=0)
        try:
            assert client.endpoint.target == f"127.0.0.1:{port}" and not client.endpoint.tls
            assert client.list_training_runs()[0].model_owner == "alice"
            assert twinkle_client._context.current() is client
        finally:
            client.close()
        assert seen[0] == {"path": "/api/v1/twinkle/endpoints", "authorization": f"Bearer {KEY}"}
        # A base URL that already ends in /api/v1 is not extended twice.
        assert resolve_endpoint(base + "/api/v1/").target == f"127.0.0.1:{port}"
    finally:
        http.shutdown()


def test_discovery_failures_are_clear():
    http, _ = discovery_server({"error": "nope"}, status=404)
    try:
        with pytest.raises(EndpointDiscoveryError, match="HTTP 404.*grpc://host:port"):
            resolve_endpoint(f"http://127.0.0.1:{http.server_address[1]}")
    finally:
        http.shutdown()
    http, _ = discovery_server({"unexpected": True})
    try:
        with pytest.raises(EndpointDiscoveryError, match="expected"):
            resolve_endpoint(f"127.0.0.1:{http.server_address[1]}")  # bare host:port means http
    finally:
        http.shutdown()
    with socket_port() as free, pytest.raises(EndpointDiscoveryError):
        resolve_endpoint(f"http://127.0.0.1:{free}", timeout_s=2)
    assert resolve_endpoint("grpcs://example.org:443").tls
    with pytest.raises(EndpointDiscoveryError):
        resolve_endpoint("grpc://no-port")


def test_all_server_errors_share_a_base():
    assert issubclass(InvalidArgumentError, ServerError) and issubclass(ServerError, twinkle_client.TwinkleClientError)
