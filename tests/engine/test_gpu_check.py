"""scripts/gpu_check.sh's CPU-side parts (no GPU here): its argument checks and the steps it
would run (the CUDA build flags, the parity and NCCL tests, which need 2 GPUs)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_dry_run_lists_the_cuda_build_and_the_gpu_steps() -> None:
    r = run("--dry-run", "--gpus", "2")
    assert r.returncode == 0, r.stderr
    steps = dict(line.removeprefix("STEP ").split(": ", 1) for line in r.stdout.splitlines() if line.startswith("STEP "))
    assert list(steps) == ["build", "kernels", "parity", "nccl", "bench"]
    assert "-DTWINKLE_WITH_CUDA=ON" in steps["build"] and "-B build-cuda" in steps["build"]
    assert "lora_ops_test --require-cuda" in steps["kernels"]
    assert "TWINKLE_TEST_DEVICE=cuda:0" in steps["parity"] and "test_precision.py" in steps["parity"]
    assert "TWINKLE_TEST_DEVICES=cuda:0,cuda:1" in steps["nccl"] and "test_data_parallel.py" in steps["nccl"]


def test_one_gpu_skips_nccl_and_options_drop_steps() -> None:
    r = run("--dry-run", "--gpus", "1", "--skip-build", "--skip-bench", "--build-dir", "/tmp/b")
    assert r.returncode == 0, r.stderr
    assert "GPU_CHECK nccl SKIP 0s (needs 2 GPUs, found 1)" in r.stdout
    assert [line.split(":")[0] for line in r.stdout.splitlines() if line.startswith("STEP ")] == [
        "STEP kernels", "STEP parity"]
    assert "/tmp/b/bin/twinkle-engine" in r.stdout


@pytest.mark.parametrize("args,needle", [
    (["--bogus"], "unknown argument '--bogus'"),
    (["--gpus", "65"], "--gpus: '65' is not a count from 0 to 64"),
    (["--gpus", "x"], "--gpus: 'x' is not a count"),
    (["--gpus"], "usage:"),
    (["--build-dir"], "usage:"),
])
def test_bad_arguments_exit_2_naming_the_problem(args: list[str], needle: str) -> None:
    r = run(*args)
    assert r.returncode == 2 and needle in r.stderr, (r.returncode, r.stderr)


def test_without_a_gpu_it_refuses_to_run() -> None:
    r = run("--gpus", "0")
    assert r.returncode == 1 and "no GPU found" in r.stderr
