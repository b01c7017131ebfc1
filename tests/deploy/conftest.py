"""Fixtures for tests/deploy: the end-to-end suite's (real server processes on free ports,
the tiny model, the built binaries), loaded from tests/e2e/conftest.py under another module
name so that both suites keep one definition."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
E2E = HERE.parent / "e2e"
sys.path.insert(0, str(E2E))
sys.path.insert(0, str(HERE))

_spec = importlib.util.spec_from_file_location("e2e_conftest", E2E / "conftest.py")
assert _spec is not None and _spec.loader is not None
_e2e = importlib.util.module_from_spec(_spec)
sys.modules["e2e_conftest"] = _e2e
_spec.loader.exec_module(_e2e)

launch_server = _e2e.launch_server
server_bin = _e2e.server_bin
tiny_model = _e2e.tiny_model
repo_root = _e2e.repo_root
