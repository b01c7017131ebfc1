"""Calling the server: auth metadata, deadlines, retries of transient failures, progress.

Retried: UNAVAILABLE (the server is restarting, draining or not reachable yet) with exponential
back-off, or after the retry-after the server sent; RESOURCE_EXHAUSTED only when the server sent
retry-after (a rate limit: quota errors without it are final). Calls that queue work carry an
idempotency key that stays the same across retries, so a retry never runs an op twice.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from twinkle_client.errors import ServerError, from_rpc_error

Metadata = Sequence[tuple[str, str]]
ProgressCallback = Callable[[str, float], None]


@dataclass(frozen=True)
class RetryPolicy:
    """How transient failures are retried. max_attempts counts the first try."""

    max_attempts: int = 6
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    multiplier: float = 2.0
    jitter: float = 0.2
    max_retry_after_s: float = 300.0

    def delay(self, error: ServerError, attempt: int, rng: random.Random) -> float | None:
        """Seconds to wait before attempt + 1, or None when error is final."""
        if attempt >= self.max_attempts:
            return None
        code = error.code
        if code == "RESOURCE_EXHAUSTED" and error.retry_after is None:
            return None
        if code not in ("UNAVAILABLE", "RESOURCE_EXHAUSTED"):
            return None
        if error.retry_after is not None:
            if error.retry_after > self.max_retry_after_s:
                return None
            return error.retry_after + rng.uniform(0.0, self.jitter)
        backoff = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 1))
        return backoff * (1.0 + rng.uniform(-self.jitter, self.jitter))


NO_RETRY = RetryPolicy(max_attempts=1)


def stderr_progress(label: str, elapsed_s: float) -> None:
    """The default progress report: one line on stderr per report."""
    print(f"[twinkle_client] {label}: still running after {elapsed_s:.0f} s", file=sys.stderr, flush=True)


class Caller:
    """Invokes unary RPCs with the client's key, deadline, retry policy and progress setting."""

    def __init__(self, metadata: Metadata, timeout_s: float | None, retry: RetryPolicy,
                 progress: bool | ProgressCallback = False, progress_interval_s: float = 10.0,
                 sleep: Callable[[float], None] = time.sleep, logger: Any = None) -> None:
        self.metadata = list(metadata)
        self.timeout_s = timeout_s
        self.retry = retry
        self.progress = progress
        self.progress_interval_s = progress_interval_s
        self.sleep = sleep
        self.logger = logger
        self._rng = random.Random()

    def __call__(self, method: Any, request: Any, *, name: str, timeout_s: float | None = None,
                 progress: bool | ProgressCallback | None = None) -> Any:
        """method(request) with retries; raises the typed ServerError when it fails for good."""
        attempt = 0
        report = self._reporter(self.progress if progress is None else progress)
        while True:
            attempt += 1
            try:
                return self._once(method, request, name, self.timeout_s if timeout_s is None else timeout_s, report)
            except grpc.RpcError as raw:
                error = from_rpc_error(raw, name, attempt)
                delay = self.retry.delay(error, attempt, self._rng)
                if delay is None:
                    raise error from None
                if self.logger is not None:
                    self.logger.warning(f"{name}: {error.code}: {error.message}; retrying in {delay:.1f} s "
                                        f"(attempt {attempt + 1} of {self.retry.max_attempts})")
                self.sleep(delay)

    def _once(self, method: Any, request: Any, name: str, timeout_s: float | None,
              report: ProgressCallback | None) -> Any:
        if report is None:
            return method(request, metadata=self.metadata, timeout=timeout_s)
        future = method.future(request, metadata=self.metadata, timeout=timeout_s)
        start = time.monotonic()
        while True:
            try:
                return future.result(timeout=self.progress_interval_s)
            except grpc.FutureTimeoutError:
                report(name, time.monotonic() - start)

    @staticmethod
    def _reporter(progress: bool | ProgressCallback) -> ProgressCallback | None:
        if callable(progress):
            return progress
        return stderr_progress if progress else None
