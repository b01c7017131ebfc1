"""Running the short-lived twinkle-server subcommands (check-config, print-config, --help)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from e2e_support.waiting import scaled

CLI_TIMEOUT_S = 30.0


def run_cli(
    server_bin: Path, *args: str, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """Run twinkle-server with args; output captured as text, bounded by CLI_TIMEOUT_S."""
    return subprocess.run(
        [str(server_bin), *args],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=scaled(CLI_TIMEOUT_S),
        check=False,
    )


def describe(result: subprocess.CompletedProcess[str]) -> str:
    """Command, exit code and output, for assertion messages."""
    command = " ".join(str(a) for a in result.args)
    return (
        f"$ {command}\nexit code {result.returncode}\n"
        f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    )


def lines_with_all(text: str, *needles: str) -> list[str]:
    """Lines of text that contain every needle."""
    return [line for line in text.splitlines() if all(n in line for n in needles)]
