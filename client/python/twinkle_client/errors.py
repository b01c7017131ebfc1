"""Typed exceptions. Every error the server returns is a ServerError subclass named after its
gRPC status code, carrying the code, the server's message and the retry-after it sent."""

from __future__ import annotations

from typing import Any

import grpc


class TwinkleClientError(Exception):
    """Base of every error this SDK raises."""


class EndpointDiscoveryError(TwinkleClientError):
    """The HTTP base URL did not lead to a gRPC endpoint."""


class NotConnectedError(TwinkleClientError):
    """A server call was needed before init_twinkle_client(...) connected one."""


class UnsupportedFeatureError(TwinkleClientError, NotImplementedError):
    """A Twinkle feature twinkle-server does not offer (named in the message)."""


class ServerError(TwinkleClientError):
    """The server answered a call with an error status.

    code: the status name ("INVALID_ARGUMENT", ...); status: the grpc.StatusCode; message: the
    server's text; method: the RPC; retry_after: seconds the server asked to wait (rate limits),
    else None; attempts: how many times the call was tried.
    """

    status: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, *, method: str = "", retry_after: float | None = None,
                 attempts: int = 1, debug: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.method = method
        self.retry_after = retry_after
        self.attempts = attempts
        self.debug = debug

    @property
    def code(self) -> str:
        return str(self.status.name)

    def __str__(self) -> str:
        where = f"{self.method}: " if self.method else ""
        tries = f" (after {self.attempts} attempts)" if self.attempts > 1 else ""
        return f"{where}{self.code}: {self.message}{tries}"


class CancelledError(ServerError):
    status = grpc.StatusCode.CANCELLED


class UnknownError(ServerError):
    status = grpc.StatusCode.UNKNOWN


class InvalidArgumentError(ServerError, ValueError):
    status = grpc.StatusCode.INVALID_ARGUMENT


class DeadlineExceededError(ServerError, TimeoutError):
    status = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(ServerError, LookupError):
    status = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(ServerError):
    status = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(ServerError, PermissionError):
    status = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhaustedError(ServerError):
    status = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(ServerError):
    status = grpc.StatusCode.FAILED_PRECONDITION


class AbortedError(ServerError):
    status = grpc.StatusCode.ABORTED


class OutOfRangeError(ServerError):
    status = grpc.StatusCode.OUT_OF_RANGE


class UnimplementedError(ServerError, NotImplementedError):
    status = grpc.StatusCode.UNIMPLEMENTED


class InternalError(ServerError):
    status = grpc.StatusCode.INTERNAL


class UnavailableError(ServerError):
    status = grpc.StatusCode.UNAVAILABLE


class DataLossError(ServerError):
    status = grpc.StatusCode.DATA_LOSS


class UnauthenticatedError(ServerError):
    status = grpc.StatusCode.UNAUTHENTICATED


ERROR_CLASSES: dict[grpc.StatusCode, type[ServerError]] = {
    cls.status: cls for cls in (
        CancelledError, UnknownError, InvalidArgumentError, DeadlineExceededError, NotFoundError,
        AlreadyExistsError, PermissionDeniedError, ResourceExhaustedError, FailedPreconditionError,
        AbortedError, OutOfRangeError, UnimplementedError, InternalError, UnavailableError,
        DataLossError, UnauthenticatedError,
    )
}


def retry_after_seconds(error: Any) -> float | None:
    """The server's retry-after trailing metadata (whole seconds), if any."""
    try:
        metadata = error.trailing_metadata() or ()
    except Exception:  # noqa: BLE001 - not every RpcError carries metadata
        return None
    for key, value in metadata:
        if key.lower() == "retry-after":
            try:
                return max(0.0, float(value))
            except (TypeError, ValueError):
                return None
    return None


def from_rpc_error(error: grpc.RpcError, method: str = "", attempts: int = 1) -> ServerError:
    """The typed exception for a failed call."""
    status = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    message = error.details() if hasattr(error, "details") else str(error)
    debug = error.debug_error_string() if hasattr(error, "debug_error_string") else ""
    cls = ERROR_CLASSES.get(status, UnknownError)
    return cls(message or status.name, method=method, retry_after=retry_after_seconds(error),
               attempts=attempts, debug=debug or "")
