"""logging.format: json. A short end-to-end run (HTTP, gRPC, the tinker SDK) against a real
server; then every line the server and its engine workers wrote to stderr must be one JSON
object with the documented fields, every request id a client got back (X-Request-Id header,
x-request-id gRPC trailer) must be in a request line, and no API key may be anywhere."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
import pytest
import requests
from e2e_support.server import ServerProcess
from e2e_support.training import KEYS, auth_overrides
from e2e_support.waiting import scaled, wait_until
from twinkle_client._proto.twinkle.v1 import utility_pb2 as upb
from twinkle_client._proto.twinkle.v1 import utility_pb2_grpc as ugrpc

import workload

LINE_FIELDS = {"time", "level", "component", "msg"}
REQUEST_FIELDS = {"request_id", "op", "outcome", "duration_ms"}


def parse_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        try:
            obj = json.loads(line)
        except ValueError:
            pytest.fail(f"stderr line {number} is not JSON: {line!r}")
        assert isinstance(obj, dict), f"line {number} is not an object: {line!r}"
        missing = LINE_FIELDS - obj.keys()
        assert not missing, f"line {number} lacks {missing}: {line!r}"
        assert obj["level"] in {"debug", "info", "warning", "error"}, line
        lines.append(obj)
    return lines


def request_lines(server: ServerProcess) -> dict[str, dict[str, Any]]:
    by_id = {}
    for obj in parse_lines(server.stderr_text()):
        if obj["msg"] == "request":
            missing = REQUEST_FIELDS - obj.keys()
            # RetrieveFuture over gRPC (TinkerService) is finished outside the common handler:
            # its line has no duration. Every other request line has all four.
            assert not (missing - {"duration_ms"}), f"request line lacks {missing}: {obj}"
            by_id[obj["request_id"]] = obj
    return by_id


def grpc_server_info(server: ServerProcess, key: str, request_id: str | None) -> str:
    """UtilityService/GetServerInfo; returns the x-request-id trailer."""
    with grpc.insecure_channel(server.grpc_address) as channel:
        stub = ugrpc.UtilityServiceStub(channel)
        metadata = [("authorization", f"Bearer {key}")]
        if request_id is not None:
            metadata.append(("x-request-id", request_id))
        _, call = stub.GetServerInfo.with_call(upb.GetServerInfoRequest(), metadata=metadata, timeout=30)
        trailers = dict(call.trailing_metadata())
    assert "x-request-id" in trailers, trailers
    return str(trailers["x-request-id"])


def test_json_logs_carry_every_request_id(launch_server: Any) -> None:
    server = launch_server(auth_overrides(logging={"level": "info", "format": "json"}))
    alice, bob = KEYS["alice"], KEYS["bob"]
    expected: dict[str, dict[str, Any]] = {}  # request id -> fields its line must have

    # HTTP: a fresh id per request, returned in X-Request-Id.
    r = requests.get(server.http_url("/api/v1/get_server_capabilities"), headers={"X-Api-Key": alice},
                     timeout=scaled(30))
    assert r.status_code == 200, r.text
    expected[r.headers["X-Request-Id"]] = {"tenant": "alice", "op": "GET /api/v1/get_server_capabilities",
                                            "outcome": "200", "component": "http"}
    # A client's own id is kept; one that could forge a line or bloat it is replaced.
    r = requests.get(server.http_url("/api/v1/get_server_capabilities"),
                     headers={"X-Api-Key": bob, "X-Request-Id": "trace-42.a_b:c"}, timeout=scaled(30))
    assert r.headers["X-Request-Id"] == "trace-42.a_b:c"
    expected["trace-42.a_b:c"] = {"tenant": "bob", "outcome": "200"}
    r = requests.get(server.http_url("/api/v1/get_server_capabilities"),
                     headers={"X-Api-Key": bob, "X-Request-Id": "x" * 65}, timeout=scaled(30))
    assert r.headers["X-Request-Id"] != "x" * 65 and len(r.headers["X-Request-Id"]) == 16
    expected[r.headers["X-Request-Id"]] = {"tenant": "bob"}
    # Refused (wrong key) and unknown routes get ids too; no tenant is claimed for them.
    r = requests.get(server.http_url("/api/v1/get_server_capabilities"), headers={"X-Api-Key": "tml-wrong"},
                     timeout=scaled(30))
    assert r.status_code == 401
    expected[r.headers["X-Request-Id"]] = {"outcome": "401", "tenant": None}
    r = requests.get(server.http_url("/no/such/route"), timeout=scaled(30))
    assert r.status_code == 404
    expected[r.headers["X-Request-Id"]] = {"outcome": "404", "op": "HTTP other"}

    # gRPC: the id comes back in the x-request-id trailer.
    expected[grpc_server_info(server, alice, None)] = {"tenant": "alice", "op": "UtilityService/GetServerInfo",
                                                       "outcome": "OK", "component": "grpc"}
    assert grpc_server_info(server, bob, "grpc-trace-7") == "grpc-trace-7"
    expected["grpc-trace-7"] = {"tenant": "bob", "outcome": "OK"}

    # The tinker SDK's whole conversation (sessions, forward_backward, futures).
    losses = workload.forward_backward(f"http://{server.host}:{server.http_port}", alice)
    assert len(losses) == 2

    # Lines are written before the response; wait for the last one anyway (stderr is a file).
    last = "grpc-trace-7"
    wait_until(lambda: last in server.stderr_text(), scaled(10), "the last request line")
    lines = request_lines(server)
    for request_id, fields in expected.items():
        assert request_id in lines, f"request id {request_id} is not in the logs"
        line = lines[request_id]
        for name, value in fields.items():
            assert line.get(name) == value, f"{request_id}: {name} is {line.get(name)!r}, want {value!r}: {line}"
        assert isinstance(line["duration_ms"], (int, float)) and line["duration_ms"] >= 0
    sdk_lines = [line for line in lines.values() if line.get("tenant") == "alice" and "forward_backward" in line["op"]]
    assert sdk_lines, "the SDK's forward_backward left no request line"
    text = server.stderr_text()
    for key in KEYS.values():
        assert key not in text, "an API key is in the logs"
    assert "tml-wrong" not in text


def test_text_stays_the_default(launch_server: Any) -> None:
    server = launch_server()
    r = requests.get(server.http_url("/no/such/route"), timeout=scaled(30))
    request_id = r.headers["X-Request-Id"]
    wait_until(lambda: request_id in server.stderr_text(), scaled(10), "the request line")
    line = next(l for l in server.stderr_text().splitlines() if request_id in l)
    assert not line.startswith("{"), line
    assert f"request_id={request_id}" in line and 'op="HTTP other" outcome=404' in line, line
