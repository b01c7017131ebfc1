"""The twinkle-server command line: check-config, print-config, --help, --version, and the
startup errors of launch (bad config, missing model, port in use, exposed without auth)."""

from __future__ import annotations

import json
import re
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from e2e_support import configs
from e2e_support.cli import describe, lines_with_all, run_cli
from e2e_support.server import LaunchConfigFile, LaunchServer, ServerProcess
from e2e_support.waiting import scaled

CONFIG_ERROR_EXIT = 2
VERSION_RE = re.compile(r"\b\d+\.\d+\.\d+")
STARTUP_FAILURE_TIMEOUT_S = 30.0


def valid_config_text(model: Path) -> str:
    return configs.to_yaml(configs.base_config(model))


def wait_startup_failure(server: ServerProcess) -> tuple[int, str]:
    """Exit code and stderr of a launch that must refuse to start (bounded wait)."""
    code = server.wait_exit(scaled(STARTUP_FAILURE_TIMEOUT_S))
    assert code is not None, (
        f"launch is still running; it should have refused to start\n{server.logs()}"
    )
    assert code != 0, f"launch exited 0; it should have refused to start\n{server.logs()}"
    return code, server.stderr_text()


def file_line_refs(path: Path, line: int) -> tuple[str, ...]:
    """FILE:LINE as the path was given, or as the server may resolve it."""
    return tuple(dict.fromkeys((f"{path}:{line}", f"{path.resolve()}:{line}")))


def assert_names(stderr: str, key: str, refs: tuple[str, ...], context: str) -> None:
    """One line of stderr holds both the dotted key and FILE:LINE."""
    hits = [line for ref in refs for line in lines_with_all(stderr, ref, key)]
    assert hits, f"no stderr line names both {key!r} and one of {refs}\n{context}"


# --- config errors: check-config and launch exit 2, naming FILE:LINE and the key ------------


@dataclass(frozen=True)
class BadConfig:
    name: str
    old_line: str | None  # the valid line to replace; None appends new_text
    new_text: str
    key: str

    def apply(self, valid: str) -> str:
        if self.old_line is None:
            return valid + self.new_text + "\n"
        return configs.replace_line(valid, self.old_line, self.new_text)

    def line(self, text: str) -> int:
        return configs.line_of(text, self.new_text.splitlines()[0])


BAD_CONFIGS = [
    BadConfig("unknown-key", "  grpc_port: 0", "  grpc_prot: 0", "server.grpc_prot"),
    BadConfig("unknown-section", None, "modle:\n  path: somewhere", "modle"),
    BadConfig("port-not-a-number", "  grpc_port: 0", "  grpc_port: fifty", "server.grpc_port"),
    BadConfig(
        "int-given-a-list", "  max_adapters: 64", "  max_adapters: [1, 2]", "limits.max_adapters"
    ),
    BadConfig("port-too-large", "  http_port: 0", "  http_port: 70000", "server.http_port"),
    BadConfig("port-negative", "  grpc_port: 0", "  grpc_port: -1", "server.grpc_port"),
    BadConfig("unknown-dtype", "  dtype: float32", "  dtype: float13", "model.dtype"),
    BadConfig("unknown-log-level", "  level: info", "  level: loud", "logging.level"),
]


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=lambda c: c.name)
def test_check_config_rejects(
    case: BadConfig, server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    text = case.apply(valid_config_text(tiny_model))
    path = configs.write_config(tmp_path / "bad.yaml", text)
    result = run_cli(server_bin, "check-config", "-c", str(path))
    assert result.returncode == CONFIG_ERROR_EXIT, describe(result)
    assert_names(result.stderr, case.key, file_line_refs(path, case.line(text)), describe(result))


@pytest.mark.parametrize("case", BAD_CONFIGS, ids=lambda c: c.name)
def test_launch_rejects(
    case: BadConfig, launch_config_file: LaunchConfigFile, tiny_model: Path, tmp_path: Path
) -> None:
    text = case.apply(valid_config_text(tiny_model))
    path = configs.write_config(tmp_path / "bad.yaml", text)
    server = launch_config_file(path)
    code, stderr = wait_startup_failure(server)
    assert code == CONFIG_ERROR_EXIT, server.logs()
    assert_names(stderr, case.key, file_line_refs(path, case.line(text)), server.logs())


def test_check_config_accepts_the_valid_config(
    server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    path = configs.write_config(tmp_path / "good.yaml", valid_config_text(tiny_model))
    result = run_cli(server_bin, "check-config", "-c", str(path))
    assert result.returncode == 0, describe(result)


def test_check_config_rejects_yaml_syntax_errors(
    server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    text = valid_config_text(tiny_model).replace("  host: 127.0.0.1", "  host: [127.0.0.1")
    path = configs.write_config(tmp_path / "broken.yaml", text)
    result = run_cli(server_bin, "check-config", "-c", str(path))
    assert result.returncode == CONFIG_ERROR_EXIT, describe(result)
    assert str(path) in result.stderr or str(path.resolve()) in result.stderr, describe(result)


def test_check_config_names_a_missing_file(server_bin: Path, tmp_path: Path) -> None:
    path = tmp_path / "no-such-config.yaml"
    result = run_cli(server_bin, "check-config", "-c", str(path))
    assert result.returncode != 0, describe(result)
    assert str(path) in result.stderr, describe(result)


# --- launch startup errors ------------------------------------------------------------------


def test_launch_fails_on_missing_model_dir(launch_server: LaunchServer, tmp_path: Path) -> None:
    missing = tmp_path / "models" / "no-such-model"
    server = launch_server({"model": {"path": str(missing)}}, wait=False)
    _, stderr = wait_startup_failure(server)
    assert lines_with_all(stderr, str(missing)), f"stderr does not name {missing}\n{server.logs()}"


def test_launch_fails_when_the_worker_cannot_load_the_model(
    launch_server: LaunchServer, tiny_model: Path, tmp_path: Path
) -> None:
    """A model whose weights file is truncated: the engine worker refuses it, and launch exits
    non-zero naming the rank and the file instead of restarting the worker forever."""
    broken = tmp_path / "models" / "truncated"
    shutil.copytree(tiny_model, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    server = launch_server({"model": {"path": str(broken)}}, wait=False)
    code, stderr = wait_startup_failure(server)
    assert code == 1, server.logs()
    assert lines_with_all(stderr, "engine rank 0", "model.safetensors"), server.logs()


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback TCP port held (bound and listening) for the duration of a test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        yield int(holder.getsockname()[1])


@pytest.mark.parametrize("which", ["grpc_port", "http_port"])
def test_launch_fails_on_port_in_use(
    launch_server: LaunchServer, busy_port: int, which: str
) -> None:
    server = launch_server({"server": {which: busy_port}}, wait=False)
    _, stderr = wait_startup_failure(server)
    assert lines_with_all(stderr, str(busy_port)), (
        f"stderr does not name port {busy_port}\n{server.logs()}"
    )


def test_launch_refuses_non_loopback_host_without_auth(launch_server: LaunchServer) -> None:
    server = launch_server({"server": {"host": "0.0.0.0"}}, wait=False)
    _, stderr = wait_startup_failure(server)
    named = lines_with_all(stderr, "server.host") or lines_with_all(stderr, "0.0.0.0")
    assert named, f"stderr names neither server.host nor 0.0.0.0\n{server.logs()}"


# --- print-config ---------------------------------------------------------------------------


def minimal_config(model: Path, directory: Path) -> Path:
    return configs.write_config(directory / "minimal.yaml", {"model": {"path": str(model)}})


def print_config(server_bin: Path, path: Path, *fmt: str) -> str:
    result = run_cli(server_bin, "print-config", "-c", str(path), *fmt)
    assert result.returncode == 0, describe(result)
    return result.stdout


def _has(config: dict[str, object], key: str) -> bool:
    try:
        configs.dotted(config, key)
    except KeyError:
        return False
    return True


def test_print_config_fills_in_the_defaults(
    server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    path = minimal_config(tiny_model, tmp_path)
    printed = yaml.safe_load(print_config(server_bin, path, "--format", "yaml"))
    assert isinstance(printed, dict), printed
    wrong = {
        key: (configs.dotted(printed, key) if _has(printed, key) else "<missing>", expected)
        for key, expected in configs.DOCUMENTED_DEFAULTS.items()
        if not _has(printed, key) or configs.dotted(printed, key) != expected
    }
    assert not wrong, f"(printed, documented default) differ: {wrong}"
    model_path = Path(str(configs.dotted(printed, "model.path")))
    assert (path.parent / model_path).resolve() == tiny_model.resolve()


def test_print_config_json_and_default_format_match_yaml(
    server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    path = minimal_config(tiny_model, tmp_path)
    as_yaml = yaml.safe_load(print_config(server_bin, path, "--format", "yaml"))
    assert json.loads(print_config(server_bin, path, "--format", "json")) == as_yaml
    assert yaml.safe_load(print_config(server_bin, path)) == as_yaml


def test_print_config_output_is_a_valid_config(
    server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    printed = print_config(server_bin, minimal_config(tiny_model, tmp_path), "--format", "yaml")
    again = configs.write_config(tmp_path / "printed.yaml", printed)
    result = run_cli(server_bin, "check-config", "-c", str(again))
    assert result.returncode == 0, describe(result)
    assert yaml.safe_load(print_config(server_bin, again)) == yaml.safe_load(printed)


def test_print_config_keeps_values_that_are_set(
    server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    config = configs.merged(configs.base_config(tiny_model), {"limits": {"max_lora_rank": 8}})
    path = configs.write_config(tmp_path / "set.yaml", config)
    printed = yaml.safe_load(print_config(server_bin, path, "--format", "yaml"))
    assert configs.dotted(printed, "limits.max_lora_rank") == 8
    assert configs.dotted(printed, "server.grpc_port") == 0


def test_print_config_rejects_an_unknown_format(
    server_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    result = run_cli(
        server_bin,
        "print-config",
        "-c",
        str(minimal_config(tiny_model, tmp_path)),
        "--format",
        "xml",
    )
    assert result.returncode != 0, describe(result)


# --- --help and --version -------------------------------------------------------------------


def test_help_lists_the_subcommands(server_bin: Path) -> None:
    result = run_cli(server_bin, "--help")
    assert result.returncode == 0, describe(result)
    for command in ("launch", "check-config", "print-config"):
        assert command in result.stdout, describe(result)


def test_launch_help_documents_the_port_file(server_bin: Path) -> None:
    result = run_cli(server_bin, "launch", "--help")
    assert result.returncode == 0, describe(result)
    assert "--port-file" in result.stdout, describe(result)


def test_version_prints_a_version(server_bin: Path) -> None:
    result = run_cli(server_bin, "--version")
    assert result.returncode == 0, describe(result)
    assert VERSION_RE.search(result.stdout), describe(result)


def test_unknown_subcommand_fails(server_bin: Path) -> None:
    result = run_cli(server_bin, "no-such-command")
    assert result.returncode != 0, describe(result)


# --- the shipped example configs ----------------------------------------------------------------

EXAMPLE_CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLE_CONFIGS, ids=lambda p: p.name)
def test_every_example_config_is_valid(server_bin: Path, path: Path, tiny_model: Path, tmp_path: Path) -> None:
    """configs/*.yaml (the default, the dedicated sampler, multi-tenant and the model-family
    examples, the two-model one) pass check-config as shipped: no key a reader copies from them
    is misspelt. An example naming a checkpoint this machine does not have gets that path (only)
    pointed at the tiny model (each entry of a models: list likewise)."""
    config = yaml.safe_load(path.read_text())
    entries = config["models"] if "models" in config else [config["model"]]
    missing = [e for e in entries if not (path.parent / e["path"]).is_dir()]
    for entry in entries:  # the copy lives elsewhere: paths that exist become absolute
        entry["path"] = str(tiny_model) if entry in missing else str((path.parent / entry["path"]).resolve())
    if missing:
        path = configs.write_config(tmp_path / path.name, config)
    result = run_cli(server_bin, "check-config", "-c", str(path))
    assert result.returncode == 0, describe(result)
