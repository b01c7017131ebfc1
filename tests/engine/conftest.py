"""Fixtures for the engine's numerical tests: tiny reference models and real engine workers."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from engine_harness import Engine  # noqa: E402
import make_reference_models  # noqa: E402

VARIANTS = sorted(make_reference_models.VARIANTS)


@pytest.fixture(scope="session")
def reference_models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every variant, made once per test session (a few seconds, no network)."""
    out = tmp_path_factory.mktemp("reference-models")
    for variant in VARIANTS:
        make_reference_models.make(variant, out)
    return out


@pytest.fixture
def engine() -> Iterator[Engine]:
    with Engine() as e:
        yield e


# The engine's device (scripts/gpu_check.sh runs the parity tests with cuda:0); the
# references stay on CPU.
DEVICE = os.environ.get("TWINKLE_TEST_DEVICE", "cpu")


def load(engine: Engine, model_dir: Path) -> dict[str, object]:
    return engine.call("load_model", {"model_dir": str(model_dir), "dtype": "float32", "device": DEVICE})
