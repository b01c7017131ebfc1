"""Bounded waiting: every wait in these tests has a deadline."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Final, TypeVar

T = TypeVar("T")

TIMEOUT_SCALE: Final = float(os.environ.get("TWINKLE_E2E_TIMEOUT_SCALE", "1"))


def scaled(seconds: float) -> float:
    """A timeout multiplied by $TWINKLE_E2E_TIMEOUT_SCALE (for slow builds, e.g. sanitizers)."""
    return seconds * TIMEOUT_SCALE


class WaitTimeout(AssertionError):
    """A bounded wait ran out of time."""


def wait_until(
    probe: Callable[[], T | None],
    timeout_s: float,
    what: str,
    interval_s: float = 0.05,
    abort: Callable[[], str | None] | None = None,
) -> T:
    """Call probe until it returns something other than None/False; return that value.

    abort, checked before every probe, returns a reason to stop waiting early (for example
    "the server exited with code 1"). Raises WaitTimeout after timeout_s.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if abort is not None and (reason := abort()) is not None:
            raise AssertionError(f"stopped waiting for {what}: {reason}")
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() >= deadline:
            raise WaitTimeout(f"timed out after {timeout_s:.1f} s waiting for {what}")
        time.sleep(min(interval_s, max(0.0, deadline - time.monotonic())))
