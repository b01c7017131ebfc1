"""twinkle-server as a running process: health, UtilityService, HTTP endpoints, metrics,
signals and worker supervision."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from e2e_support import prom, reference
from e2e_support.cli import describe, run_cli
from e2e_support.configs import SHARED_LIMITS
from e2e_support.server import LaunchServer, ServerProcess, alive, get
from e2e_support.waiting import scaled, wait_until
from twinkle_client import UtilityClient

RPC_TIMEOUT_S = 10.0
GRPC_OK_CODES = {"OK", "0"}  # the code label: the gRPC status name (or its number)


def metrics(server: ServerProcess) -> list[prom.Sample]:
    response = get(server, "/metrics")
    assert response.status_code == 200, response.text
    return prom.parse(response.text)


def method_samples(samples: list[prom.Sample], name: str, method: str) -> list[prom.Sample]:
    """Samples of name whose method label names the RPC (full path or bare name)."""
    return [s for s in prom.select(samples, name) if s.labels.get("method", "").endswith(method)]


def ok_calls(server: ServerProcess, method: str) -> float:
    samples = method_samples(metrics(server), "twinkle_requests_total", method)
    return sum(s.value for s in samples if s.labels.get("code") in GRPC_OK_CODES)


def timed_calls(server: ServerProcess, method: str) -> float:
    samples = method_samples(metrics(server), "twinkle_request_duration_seconds_count", method)
    return sum(s.value for s in samples)


# --- health and UtilityService ---------------------------------------------------------


def test_health_is_serving(server: ServerProcess) -> None:
    assert server.health() == "SERVING", server.logs()


def test_reflection_lists_every_service(server: ServerProcess) -> None:
    """Server reflection names the services a gRPC tool (grpcurl, Postman) would discover."""
    channel = grpc.insecure_channel(server.grpc_address)
    try:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        responses = stub.ServerReflectionInfo(iter([request]), timeout=scaled(RPC_TIMEOUT_S))
        names = {s.name for r in responses for s in r.list_services_response.service}
    finally:
        channel.close()
    assert {"twinkle.v1.UtilityService", "grpc.health.v1.Health"} <= names, names


def test_server_info_describes_the_model(
    server: ServerProcess, tiny_model: Path, model_parameter_count: int
) -> None:
    with UtilityClient(server.grpc_address, timeout_s=scaled(RPC_TIMEOUT_S)) as client:
        info = client.get_server_info()
    assert info.architecture == "Qwen3ForCausalLM" == reference.architecture(tiny_model)
    assert info.parameter_count == model_parameter_count
    assert info.dtype == "float32"
    assert info.base_model_id == tiny_model.name  # model.name unset: the folder's name
    assert info.base_model_name in (tiny_model.name, str(tiny_model), str(tiny_model.resolve()))
    assert info.serving is True
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", info.server_version), info.server_version


def test_server_info_reports_one_ready_cpu_device(server: ServerProcess) -> None:
    with UtilityClient(server.grpc_address, timeout_s=scaled(RPC_TIMEOUT_S)) as client:
        devices = list(client.get_server_info().devices)
    assert len(devices) == 1, devices
    assert (devices[0].rank, devices[0].device, devices[0].ready, devices[0].restarts) == (
        0,
        "cpu",
        True,
        0,
    )


def test_server_info_echoes_the_configured_limits(server: ServerProcess) -> None:
    with UtilityClient(server.grpc_address, timeout_s=scaled(RPC_TIMEOUT_S)) as client:
        info = client.get_server_info()
    assert info.limits.max_adapters == SHARED_LIMITS["max_adapters"]
    assert info.limits.max_lora_rank == SHARED_LIMITS["max_lora_rank"]
    assert info.limits.max_tokens_per_request == SHARED_LIMITS["max_tokens_per_request"]
    assert info.max_lora_rank == SHARED_LIMITS["max_lora_rank"]


def test_server_version_matches_the_cli(server: ServerProcess, server_bin: Path) -> None:
    result = run_cli(server_bin, "--version")
    assert result.returncode == 0, describe(result)
    with UtilityClient(server.grpc_address, timeout_s=scaled(RPC_TIMEOUT_S)) as client:
        version = client.get_server_info().server_version
    assert version and version in result.stdout, describe(result)


def test_capacity_is_all_free(server: ServerProcess) -> None:
    with UtilityClient(server.grpc_address, timeout_s=scaled(RPC_TIMEOUT_S)) as client:
        capacity = client.get_capacity()
    expected = SHARED_LIMITS["max_adapters"]
    assert (capacity.max_adapters, capacity.used_adapters, capacity.free_adapters) == (
        expected,
        0,
        expected,
    )


def test_one_engine_worker_is_a_child_of_the_server(server: ServerProcess) -> None:
    workers = server.engine_workers()
    assert len(workers) == 1, f"expected one twinkle-engine child, got {workers}"
    assert workers[0].ppid() == server.pid


# --- HTTP -------------------------------------------------------------------------------


def test_healthz_and_readyz_are_ok(server: ServerProcess) -> None:
    assert get(server, "/healthz").status_code == 200
    assert get(server, "/readyz").status_code == 200


def test_endpoints_names_the_grpc_address(server: ServerProcess) -> None:
    response = get(server, "/api/v1/twinkle/endpoints")
    assert response.status_code == 200, response.text
    address = f"127.0.0.1:{server.grpc_port}"
    # "grpc" is what twinkle_client's discovery reads; "grpc_address" stays for older clients.
    assert response.json() == {"grpc": address, "grpc_address": address, "tls": False}
    with UtilityClient(response.json()["grpc"], timeout_s=scaled(RPC_TIMEOUT_S)) as client:
        assert client.get_server_info().serving


def test_metrics_expose_build_info_and_worker_state(server: ServerProcess) -> None:
    response = get(server, "/metrics")
    assert response.status_code == 200
    assert response.headers.get("Content-Type", "").startswith("text/plain")
    samples = prom.parse(response.text)
    build_info = prom.select(samples, "twinkle_build_info")
    assert len(build_info) == 1 and build_info[0].value == 1, build_info
    assert prom.value(samples, "twinkle_worker_up", rank="0") == 1
    assert prom.value(samples, "twinkle_worker_restarts_total", rank="0") == 0


def test_request_metrics_count_server_info_calls(server: ServerProcess) -> None:
    calls = 3
    before, timed_before = ok_calls(server, "GetServerInfo"), timed_calls(server, "GetServerInfo")
    with UtilityClient(server.grpc_address, timeout_s=scaled(RPC_TIMEOUT_S)) as client:
        for _ in range(calls):
            client.get_server_info()
    # Counters may be updated just after the response is sent: wait, bounded, then be exact.
    wait_until(
        lambda: ok_calls(server, "GetServerInfo") >= before + calls,
        scaled(5),
        "twinkle_requests_total{method=~GetServerInfo,code=OK} to count the calls",
    )
    assert ok_calls(server, "GetServerInfo") == before + calls
    wait_until(
        lambda: timed_calls(server, "GetServerInfo") >= timed_before + calls,
        scaled(5),
        "twinkle_request_duration_seconds_count{method=~GetServerInfo} to count the calls",
    )


# --- config paths -----------------------------------------------------------------------


def test_relative_model_path_resolves_against_the_config_folder(
    launch_server: LaunchServer, tiny_model: Path, tmp_path: Path
) -> None:
    config_dir = tmp_path / "conf" / "nested"
    elsewhere = tmp_path / "elsewhere"
    config_dir.mkdir(parents=True)
    elsewhere.mkdir()
    relative = os.path.relpath(tiny_model, config_dir)
    overrides = {"model": {"path": relative, "name": "tiny-display-name"}}
    server = launch_server(overrides, config_dir=config_dir, cwd=elsewhere)
    with UtilityClient(server.grpc_address, timeout_s=scaled(RPC_TIMEOUT_S)) as client:
        info = client.get_server_info()
    assert info.base_model_id == "tiny-display-name"
    assert info.architecture == "Qwen3ForCausalLM"


# --- signals and supervision ------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_stops_server_and_workers(launch_server: LaunchServer, sig: signal.Signals) -> None:
    drain_timeout_s = 5
    server = launch_server({"server": {"drain_timeout_s": drain_timeout_s}})
    workers = server.engine_workers()
    assert workers, "no twinkle-engine child before the signal"
    started = time.monotonic()
    server.send_signal(sig)
    code = server.wait_exit(scaled(drain_timeout_s + 2))
    elapsed = time.monotonic() - started
    assert code is not None, f"still running {elapsed:.1f} s after {sig.name}\n{server.logs()}"
    assert code == 0, f"exit code {code} after {sig.name}\n{server.logs()}"
    psutil.wait_procs(alive(workers), timeout=scaled(2))
    assert not alive(workers), f"workers outlived the server: {alive(workers)}"


def poll_until_not_serving(server: ServerProcess, timeout_s: float) -> None:
    """Poll health every 20 ms until NOT_SERVING is seen (bounded)."""
    wait_until(
        lambda: server.health(timeout_s=0.5) == "NOT_SERVING",
        timeout_s,
        "health NOT_SERVING after the worker was killed",
        interval_s=0.02,
        abort=server.exit_reason,
    )


def test_killed_worker_is_restarted(launch_server: LaunchServer) -> None:
    heartbeat_timeout_ms = 3000
    server = launch_server(
        {
            "engine": {
                "restart_backoff_initial_ms": 500,
                "heartbeat_timeout_ms": heartbeat_timeout_ms,
            }
        }
    )
    [worker] = server.engine_workers()
    worker.kill()  # SIGKILL
    poll_until_not_serving(server, scaled(heartbeat_timeout_ms / 1000 + 3))
    # The restart waits at least the 500 ms back-off, so readiness is still down here.
    assert get(server, "/readyz").status_code == 503
    server.wait_health("SERVING", scaled(60))

    [new_worker] = server.engine_workers()
    assert new_worker.pid != worker.pid and new_worker.ppid() == server.pid
    wait_until(
        lambda: prom.value(metrics(server), "twinkle_worker_restarts_total", rank="0") == 1,
        scaled(5),
        'twinkle_worker_restarts_total{rank="0"} == 1',
    )
    samples = metrics(server)
    assert prom.value(samples, "twinkle_worker_up", rank="0") == 1
    with UtilityClient(server.grpc_address, timeout_s=scaled(RPC_TIMEOUT_S)) as client:
        info = client.get_server_info()
    assert info.serving and info.devices[0].ready and info.devices[0].restarts == 1
    assert get(server, "/readyz").status_code == 200


def test_silent_worker_is_killed_and_restarted(launch_server: LaunchServer) -> None:
    """A worker that stops answering (SIGSTOP: alive but silent) is detected by the missed
    heartbeats, killed, and replaced."""
    heartbeat_timeout_ms = 1000
    server = launch_server(
        {"engine": {"heartbeat_interval_ms": 100, "heartbeat_timeout_ms": heartbeat_timeout_ms,
                    "restart_backoff_initial_ms": 200}}
    )
    [worker] = server.engine_workers()
    stopped_at = time.monotonic()
    worker.send_signal(signal.SIGSTOP)
    poll_until_not_serving(server, scaled(heartbeat_timeout_ms / 1000 + 3))
    # Not before the timeout: a stopped process still exists, only its heartbeats are gone.
    assert time.monotonic() - stopped_at >= heartbeat_timeout_ms / 1000 * 0.9
    server.wait_health("SERVING", scaled(60))
    [new_worker] = server.engine_workers()
    assert new_worker.pid != worker.pid
    assert not psutil.pid_exists(worker.pid) or worker.status() == psutil.STATUS_ZOMBIE
    assert "silent for" in server.stderr_text(), server.logs()
