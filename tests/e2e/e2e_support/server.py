"""A twinkle-server process under test: launch, readiness, signals, teardown.

The server runs in its own session (process group) with stdout and stderr in files. Its
engine workers are found with psutil as descendants whose command line names
twinkle-engine. Teardown is SIGTERM, then SIGKILL after a bound, then SIGKILL for every
descendant ever seen and for the server's process group; an atexit hook does the same for
anything a crashed test run left behind.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import grpc
import psutil
import requests
from twinkle_client import HealthStatus, health

from e2e_support.waiting import scaled, wait_until

ENGINE_NAME = "twinkle-engine"
LOG_TAIL_CHARS = 4000

_LIVE: set[ServerProcess] = set()


@dataclass(eq=False)
class ServerProcess:
    """A launched `twinkle-server launch`; ports are known once wait_ports() returned."""

    proc: subprocess.Popen[bytes]
    config_path: Path
    config: dict[str, Any]
    port_file: Path
    stdout_path: Path
    stderr_path: Path
    grpc_port: int = 0
    http_port: int = 0
    seen_children: dict[int, psutil.Process] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def host(self) -> str:
        return str(self.config.get("server", {}).get("host", "127.0.0.1"))

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def http_url(self, path: str) -> str:
        return f"http://{self.host}:{self.http_port}{path}"

    # --- diagnostics -------------------------------------------------------------------

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(encoding="utf-8", errors="replace")

    def logs(self) -> str:
        """The tail of stdout and stderr, for assertion messages."""
        out = self.stdout_path.read_text(encoding="utf-8", errors="replace")
        return (
            f"--- twinkle-server stdout (tail) ---\n{out[-LOG_TAIL_CHARS:]}\n"
            f"--- twinkle-server stderr (tail) ---\n{self.stderr_text()[-LOG_TAIL_CHARS:]}"
        )

    def exit_reason(self) -> str | None:
        """None while running, else a description of the exit with the logs."""
        code = self.proc.poll()
        return None if code is None else f"twinkle-server exited with code {code}\n{self.logs()}"

    # --- readiness -----------------------------------------------------------------------

    def _read_port_file(self) -> tuple[int, int] | None:
        try:
            data = json.loads(self.port_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        ports = (data.get("grpc_port"), data.get("http_port"), data.get("pid"))
        if not all(isinstance(p, int) for p in ports):
            raise AssertionError(f"port file {self.port_file} is malformed: {data}")
        assert data["pid"] == self.pid, f"port file pid {data['pid']} != server pid {self.pid}"
        return int(data["grpc_port"]), int(data["http_port"])

    def wait_ports(self, timeout_s: float) -> None:
        """Wait for --port-file; both ports must be real (non-zero) and distinct."""
        ports = wait_until(self._read_port_file, timeout_s, "the port file", abort=self.exit_reason)
        self.grpc_port, self.http_port = ports
        assert self.grpc_port > 0 and self.http_port > 0, f"port file has zero ports: {ports}"
        assert self.grpc_port != self.http_port, f"port file repeats one port: {ports}"

    def health(self, timeout_s: float = 1.0) -> HealthStatus | None:
        """The gRPC health status of the whole server, or None when the call failed."""
        try:
            return health(self.grpc_address, timeout_s=timeout_s)
        except grpc.RpcError:
            return None

    def wait_health(self, status: HealthStatus, timeout_s: float, interval_s: float = 0.05) -> None:
        wait_until(
            lambda: self.health() == status,
            timeout_s,
            f"health {status} at {self.grpc_address}",
            interval_s=interval_s,
            abort=self.exit_reason,
        )

    # --- processes -----------------------------------------------------------------------

    def descendants(self) -> list[psutil.Process]:
        """Live descendants of the server; each is remembered for teardown."""
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        for child in children:
            self.seen_children.setdefault(child.pid, child)
        return children

    def engine_workers(self) -> list[psutil.Process]:
        """Descendants whose command line names twinkle-engine, ordered by pid."""
        workers = []
        for child in self.descendants():
            try:
                if any(ENGINE_NAME in part for part in child.cmdline()):
                    workers.append(child)
            except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
                continue
        return sorted(workers, key=lambda p: p.pid)

    def send_signal(self, sig: signal.Signals) -> None:
        self.descendants()
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float) -> int | None:
        """The exit code, or None if the server still runs after timeout_s."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, term_timeout_s: float | None = None) -> int:
        """SIGTERM, SIGKILL after term_timeout_s, then kill every leftover descendant."""
        if term_timeout_s is None:
            term_timeout_s = float(self.config.get("server", {}).get("drain_timeout_s", 10)) + 5
        if self.proc.poll() is None:
            self.send_signal(signal.SIGTERM)
            if self.wait_exit(scaled(term_timeout_s)) is None:
                self.proc.kill()
                self.proc.wait(timeout=scaled(10))
        self.kill_leftovers()
        _LIVE.discard(self)
        return self.proc.returncode

    def kill_leftovers(self) -> None:
        """SIGKILL descendants seen while the server ran, and the server's process group."""
        leftovers = [p for p in self.seen_children.values() if _alive(p)]
        for child in leftovers:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        psutil.wait_procs(leftovers, timeout=scaled(5))
        # The session launch() created; killpg fails harmlessly once it is empty.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)


def stop_all(servers: list[ServerProcess]) -> None:
    """Stop every server, even if stopping one of them fails; then raise the first failure."""
    errors: list[BaseException] = []
    for server in servers:
        try:
            server.stop()
        except BaseException as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def _alive(process: psutil.Process) -> bool:
    """Running and not a zombie (is_running() also guards against a reused pid)."""
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if _alive(p)]


class LaunchServer(Protocol):
    """The launch_server fixture: start a server on the base test config plus overrides."""

    def __call__(
        self,
        overrides: Mapping[str, Any] | None = None,
        *,
        wait: bool = True,
        config_dir: Path | None = None,
        cwd: Path | None = None,
    ) -> ServerProcess: ...


class LaunchConfigFile(Protocol):
    """The launch_config_file fixture: launch on a config file as it is (may be invalid)."""

    def __call__(self, config_path: Path) -> ServerProcess: ...


def launch(
    server_bin: Path,
    config_path: Path,
    config: dict[str, Any],
    workdir: Path,
    cwd: Path | None = None,
) -> ServerProcess:
    """Start `twinkle-server launch -c CONFIG --port-file PATH`; does not wait for anything."""
    workdir.mkdir(parents=True, exist_ok=True)
    port_file = workdir / "ports.json"
    port_file.unlink(missing_ok=True)
    stdout_path, stderr_path = workdir / "server.stdout", workdir / "server.stderr"
    command = [str(server_bin), "launch", "-c", str(config_path), "--port-file", str(port_file)]
    with open(stdout_path, "wb") as stdout, open(stderr_path, "wb") as stderr:
        proc = subprocess.Popen(
            command,
            cwd=cwd or workdir,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
    server = ServerProcess(proc, config_path, config, port_file, stdout_path, stderr_path)
    _LIVE.add(server)
    return server


def get(server: ServerProcess, path: str, timeout_s: float = 5.0) -> requests.Response:
    """HTTP GET on the server's HTTP listener."""
    return requests.get(server.http_url(path), timeout=scaled(timeout_s))


@atexit.register
def _kill_all_live() -> None:
    """Last resort for a run that ended without fixture teardown."""
    for server in list(_LIVE):
        if server.proc.poll() is None:
            server.descendants()
            server.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.wait(timeout=5)
        server.kill_leftovers()
        _LIVE.discard(server)
