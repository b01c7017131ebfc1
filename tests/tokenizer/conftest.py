"""Fixtures for the tokenizer equality tests: the twinkle-tokenize tool and the families'
tokenizers, trained once per session into a temporary directory."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import families  # noqa: E402
from tool import TokenizeTool  # noqa: E402

REPO_ROOT = HERE.parent.parent
TOOL_ENV = "TWINKLE_TOKENIZE_BIN"


@pytest.fixture(scope="session")
def tokenize_bin() -> Path:
    """build/bin/twinkle-tokenize; fails, never skips, if absent."""
    binary = Path(os.environ.get(TOOL_ENV, REPO_ROOT / "build" / "bin" / "twinkle-tokenize"))
    if not binary.is_file():
        pytest.fail(f"{binary} is not built: cmake --build build --target twinkle-tokenize (or set {TOOL_ENV})",
                    pytrace=False)
    return binary


@pytest.fixture(scope="session")
def family_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("families")
    return {f.name: families.build(f, out) for f in families.FAMILIES}


@pytest.fixture(scope="session")
def tools(tokenize_bin: Path, family_paths: dict[str, Path]):
    started = {name: TokenizeTool(tokenize_bin, path) for name, path in family_paths.items()}
    yield started
    for tool in started.values():
        tool.close()
