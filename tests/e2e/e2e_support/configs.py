"""Server config files for the tests: a complete valid config, overrides, line lookup."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

Config = dict[str, Any]

# The documented defaults, as print-config must show them for a config that sets only
# model.path (model.name is left out: its default is derived from the folder name).
DOCUMENTED_DEFAULTS: Mapping[str, object] = {
    "server.host": "127.0.0.1",
    "server.grpc_port": 50051,
    "server.http_port": 8000,
    "server.drain_timeout_s": 10,
    "model.dtype": "float32",
    "engine.devices": ["cpu"],
    "engine.heartbeat_interval_ms": 200,
    "engine.heartbeat_timeout_ms": 3000,
    "engine.startup_timeout_s": 120,
    "engine.restart_backoff_initial_ms": 500,
    "engine.restart_backoff_max_ms": 30000,
    "limits.max_adapters": 64,
    "limits.max_lora_rank": 128,
    "limits.max_tokens_per_request": 32768,
    "logging.level": "info",
}


# The shared server's limits: not the defaults, so echoing them back is a real check.
SHARED_LIMITS: Mapping[str, int] = {
    "max_adapters": 7,
    "max_lora_rank": 16,
    "max_tokens_per_request": 4096,
}


def base_config(model_path: Path | str) -> Config:
    """A complete, valid test config: loopback, ports chosen by the OS, one CPU worker."""
    return {
        "server": {"host": "127.0.0.1", "grpc_port": 0, "http_port": 0, "drain_timeout_s": 5},
        "model": {"path": str(model_path), "dtype": "float32"},
        "engine": {
            "devices": ["cpu"],
            "heartbeat_interval_ms": 200,
            "heartbeat_timeout_ms": 3000,
            "startup_timeout_s": 120,
            "restart_backoff_initial_ms": 500,
            "restart_backoff_max_ms": 30000,
        },
        "limits": {"max_adapters": 64, "max_lora_rank": 64, "max_tokens_per_request": 32768},
        "logging": {"level": "info"},
    }


def merged(base: Mapping[str, Any], overrides: Mapping[str, Any] | None) -> Config:
    """A deep copy of base with overrides merged in (nested mappings merge, the rest replace)."""
    result: Config = copy.deepcopy(dict(base))
    for key, value in (overrides or {}).items():
        if isinstance(value, Mapping) and isinstance(result.get(key), Mapping):
            result[key] = merged(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def to_yaml(config: Mapping[str, Any]) -> str:
    """Block-style YAML, keys in insertion order, one key per line (so lines can be found)."""
    return yaml.safe_dump(dict(config), sort_keys=False, default_flow_style=False)


def write_config(path: Path, config: Mapping[str, Any] | str) -> Path:
    """Write a config (a mapping, or YAML text as it is) to path and return path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config if isinstance(config, str) else to_yaml(config), encoding="utf-8")
    return path


def line_of(text: str, needle: str) -> int:
    """1-based number of the only line of text that contains needle."""
    hits = [n for n, line in enumerate(text.splitlines(), start=1) if needle in line]
    if len(hits) != 1:
        raise ValueError(f"{needle!r} is on lines {hits} of the config, expected exactly one")
    return hits[0]


def replace_line(text: str, old: str, new: str) -> str:
    """text with the only line equal to old (ignoring trailing spaces) replaced by new."""
    lines = text.splitlines()
    hits = [n for n, line in enumerate(lines) if line.rstrip() == old]
    if len(hits) != 1:
        raise ValueError(f"{old!r} matches lines {hits} of the config, expected exactly one")
    lines[hits[0]] = new
    return "\n".join(lines) + "\n"


def dotted(config: Mapping[str, Any], key: str) -> object:
    """config["a"]["b"] for key "a.b"; KeyError names the missing dotted key."""
    node: object = config
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node
