"""Where the repository, the binaries, the client package and the tiny model are."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

REPO_ROOT: Final = Path(__file__).resolve().parents[3]
CLIENT_DIR: Final = REPO_ROOT / "client" / "python"
MAKE_TINY_MODEL: Final = REPO_ROOT / "scripts" / "make_tiny_model.py"
CHECKED_OUT_MODEL: Final = REPO_ROOT / "models" / "tiny-qwen3"
TINY_MODEL_DIRNAME: Final = "tiny-qwen3"

SERVER_BIN_ENV: Final = "TWINKLE_SERVER_BIN"
TINY_MODEL_ENV: Final = "TWINKLE_TINY_MODEL"


def server_binary() -> Path:
    """$TWINKLE_SERVER_BIN, else <repo>/build/bin/twinkle-server (it may not exist)."""
    override = os.environ.get(SERVER_BIN_ENV)
    return Path(override).resolve() if override else REPO_ROOT / "build" / "bin" / "twinkle-server"


def engine_binary(server_bin: Path) -> Path:
    """The worker binary the server spawns: twinkle-engine next to twinkle-server."""
    return server_bin.parent / "twinkle-engine"


def missing_binaries(server_bin: Path) -> list[str]:
    """Human-readable problems with the two binaries; empty when both are runnable."""
    problems = []
    for binary in (server_bin, engine_binary(server_bin)):
        if not binary.is_file():
            problems.append(f"{binary} does not exist")
        elif not os.access(binary, os.X_OK):
            problems.append(f"{binary} is not executable")
    return problems


def looks_like_model(directory: Path) -> bool:
    return (directory / "config.json").is_file() and any(directory.glob("*.safetensors"))


def reusable_model() -> Path | None:
    """$TWINKLE_TINY_MODEL, else <repo>/models/tiny-qwen3 when it holds a model."""
    override = os.environ.get(TINY_MODEL_ENV)
    if override:
        return Path(override).resolve()
    return CHECKED_OUT_MODEL if looks_like_model(CHECKED_OUT_MODEL) else None
