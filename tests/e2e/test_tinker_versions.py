"""The Tinker acceptance sequence (e2e_support/tinker_acceptance.py) with every tinker SDK
release the server bridges: 0.16.1 (JSON forward_backward, the oldest release ModelScope
Twinkle targets), 0.25.0 (protobuf forward_backward), 0.30.4 (loss_fn_config_v2,
retrieve_futures, record_stability_info) and the pinned 0.38.0. Each older release runs
unmodified from its own wheel, unpacked by scripts/setup.sh into .tinker-sdks/<version>
(offline here: no index is reached), in a subprocess whose PYTHONPATH puts it before the
venv's 0.38.0; their dependencies are the venv's. docs/tinker_compat.md lists what differs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_support import paths
from e2e_support.server import LaunchServer
from e2e_support.training import KEYS, auth_overrides

SDK_DIR = paths.REPO_ROOT / ".tinker-sdks"
SCRIPT = Path(__file__).resolve().parent / "e2e_support" / "tinker_acceptance.py"
OLDER = ["0.16.1", "0.25.0", "0.30.4"]


@pytest.mark.parametrize("version", OLDER + ["0.38.0"])
def test_acceptance_sequence_with_sdk(version: str, launch_server: LaunchServer, tmp_path: Path) -> None:
    env = dict(os.environ)
    if version in OLDER:
        sdk = SDK_DIR / version
        assert (sdk / "tinker" / "__init__.py").is_file(), f"{sdk}: run scripts/setup.sh (it unpacks the SDK wheels)"
        env["PYTHONPATH"] = str(sdk)
    server = launch_server(auth_overrides(storage={"data_dir": str(tmp_path / "data")}))
    result = subprocess.run([sys.executable, str(SCRIPT), f"http://{server.host}:{server.http_port}", KEYS["alice"],
                             "tiny-qwen3"], capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, f"tinker {version}:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    report = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"tinker {version}: {report}")
    assert report["sdk"] == version
    # 0.16.1 validates loss_fn against its own five names before sending (JSON body); the
    # protobuf releases send any name, gspo included.
    assert report["skipped"] == (["gspo"] if version == "0.16.1" else [])
    assert set(report["losses"]) >= {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro"}
