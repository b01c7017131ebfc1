"""Fixtures for the SDK unit tests: the checkout's client packages first on sys.path (with
their generated gRPC code made or refreshed), and the tiny model's tokenizer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = REPO_ROOT / "client" / "python"
TINY_MODEL = REPO_ROOT / "models" / "tiny-qwen3"
MAKE_TINY_MODEL = REPO_ROOT / "scripts" / "make_tiny_model.py"

sys.path.insert(0, str(CLIENT_DIR))


def _prepare_client() -> None:
    import generate_protos  # client/python/generate_protos.py

    generate_protos.ensure_generated()
    import twinkle
    import twinkle_client

    for module in (twinkle, twinkle_client):
        location = Path(module.__file__).resolve()
        if not location.is_relative_to(CLIENT_DIR):
            raise RuntimeError(f"{module.__name__} imported from {location}, not from {CLIENT_DIR}")


_prepare_client()


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/tiny-qwen3 (Qwen chat tokens and a ChatML chat template), made when missing."""
    if (TINY_MODEL / "tokenizer.json").is_file():
        return TINY_MODEL
    target = tmp_path_factory.mktemp("models") / "tiny-qwen3"
    result = subprocess.run([sys.executable, str(MAKE_TINY_MODEL), str(target)],
                            capture_output=True, text=True, timeout=600, check=False)
    if result.returncode != 0:
        pytest.fail(f"make_tiny_model.py failed:\n{result.stdout}\n{result.stderr}", pytrace=False)
    return target
