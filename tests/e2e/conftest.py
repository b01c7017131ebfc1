"""Fixtures for the end-to-end tests: binaries, the tiny model, servers on free ports.

The checkout's client (client/python) goes first on sys.path, with its generated protos
made or refreshed here, so the tests exercise this tree's twinkle_client, not an installed
copy. A missing server binary fails the tests that need it, with the path in the message;
nothing is skipped.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from e2e_support import paths  # noqa: E402

sys.path.insert(0, str(paths.CLIENT_DIR))


def _prepare_client() -> None:
    """Generate twinkle_client/_proto if missing or stale; check the checkout's copy is used."""
    import generate_protos  # client/python/generate_protos.py

    generate_protos.ensure_generated()
    import twinkle_client

    location = Path(twinkle_client.__file__).resolve()
    if not location.is_relative_to(paths.CLIENT_DIR):
        raise RuntimeError(f"twinkle_client imported from {location}, not from {paths.CLIENT_DIR}")


_prepare_client()

from e2e_support import configs, reference  # noqa: E402
from e2e_support.server import (  # noqa: E402
    LaunchConfigFile,
    LaunchServer,
    ServerProcess,
    launch,
    stop_all,
)
from e2e_support.waiting import scaled  # noqa: E402

STARTUP_TIMEOUT_S = 120.0
MAKE_MODEL_TIMEOUT_S = 600.0


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return paths.REPO_ROOT


@pytest.fixture(scope="session")
def server_bin() -> Path:
    """build/bin/twinkle-server (and twinkle-engine beside it); fails, never skips, if absent."""
    binary = paths.server_binary()
    problems = paths.missing_binaries(binary)
    if problems:
        pytest.fail(
            "twinkle-server binaries are not built: "
            + "; ".join(problems)
            + f". Build them (cmake --build build) or set {paths.SERVER_BIN_ENV}.",
            pytrace=False,
        )
    return binary


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/tiny-qwen3 when present, else one made for this session by make_tiny_model.py."""
    reused = paths.reusable_model()
    if reused is not None:
        if not paths.looks_like_model(reused):
            pytest.fail(f"{reused} has no config.json and *.safetensors", pytrace=False)
        return reused
    target = tmp_path_factory.mktemp("models") / paths.TINY_MODEL_DIRNAME
    result = subprocess.run(
        [sys.executable, str(paths.MAKE_TINY_MODEL), str(target)],
        capture_output=True,
        text=True,
        timeout=scaled(MAKE_MODEL_TIMEOUT_S),
        check=False,
    )
    if result.returncode != 0 or not paths.looks_like_model(target):
        pytest.fail(
            f"make_tiny_model.py failed ({result.returncode}):\n{result.stdout}\n{result.stderr}",
            pytrace=False,
        )
    return target


@pytest.fixture(scope="session")
def model_parameter_count(tiny_model: Path) -> int:
    """The reference count, from the safetensors headers."""
    return reference.parameter_count(tiny_model)


def _start(
    server_bin: Path,
    model: Path,
    workdir: Path,
    overrides: Mapping[str, Any] | None,
    config_dir: Path | None = None,
    cwd: Path | None = None,
) -> ServerProcess:
    """Write the base test config merged with overrides and launch; waits for nothing."""
    config = configs.merged(configs.base_config(model), overrides)
    config_path = configs.write_config((config_dir or workdir) / "twinkle.yaml", config)
    return launch(server_bin, config_path, config, workdir, cwd=cwd)


def _wait_serving(server: ServerProcess) -> None:
    server.wait_ports(scaled(STARTUP_TIMEOUT_S))
    server.wait_health("SERVING", scaled(STARTUP_TIMEOUT_S))


@pytest.fixture
def launch_server(server_bin: Path, tiny_model: Path, tmp_path: Path) -> Iterator[LaunchServer]:
    """A factory: start(overrides) launches a server on the base test config merged with
    overrides and, with wait=True, returns once it is SERVING. All are stopped at teardown."""
    started: list[ServerProcess] = []

    def start(
        overrides: Mapping[str, Any] | None = None,
        *,
        wait: bool = True,
        config_dir: Path | None = None,
        cwd: Path | None = None,
    ) -> ServerProcess:
        workdir = tmp_path / f"server-{len(started)}"
        server = _start(server_bin, tiny_model, workdir, overrides, config_dir, cwd)
        started.append(server)
        if wait:
            _wait_serving(server)
        return server

    try:
        yield start
    finally:
        stop_all(started)


@pytest.fixture
def launch_config_file(server_bin: Path, tmp_path: Path) -> Iterator[LaunchConfigFile]:
    """start(path) runs `twinkle-server launch` on a config file as it is (for startup-error
    tests; waits for nothing). All are stopped at teardown."""
    started: list[ServerProcess] = []

    def start(config_path: Path) -> ServerProcess:
        try:
            parsed = yaml.safe_load(config_path.read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            parsed = None
        config = parsed if isinstance(parsed, dict) else {}
        server = launch(server_bin, config_path, config, tmp_path / f"launch-{len(started)}")
        started.append(server)
        return server

    try:
        yield start
    finally:
        stop_all(started)


@pytest.fixture(scope="session")
def server(
    server_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """One SERVING server shared by the read-only tests. Its limits differ from the defaults,
    so echoing them back is a real check."""
    workdir = tmp_path_factory.mktemp("shared-server")
    shared = _start(server_bin, tiny_model, workdir, {"limits": configs.SHARED_LIMITS})
    try:
        _wait_serving(shared)
        yield shared
    finally:
        stop_all([shared])
