"""UtilityService client (server facts and capacity) and a gRPC health check helper."""

from __future__ import annotations

from types import TracebackType
from typing import Literal, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

try:
    from twinkle_client._proto.twinkle.v1 import utility_pb2, utility_pb2_grpc
except ImportError as exc:  # pragma: no cover - depends on the checkout's state
    raise ImportError(
        "twinkle_client._proto is missing or stale: run client/python/generate_protos.py"
    ) from exc

HealthStatus = Literal["UNKNOWN", "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"]

DEFAULT_TIMEOUT_S = 10.0


class UtilityClient:
    """Blocking client for twinkle.v1.UtilityService; every call has a deadline of timeout_s.

    Failed calls raise grpc.RpcError. Use as a context manager or call close().
    """

    def __init__(self, address: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address)
        self._stub = utility_pb2_grpc.UtilityServiceStub(self._channel)

    def get_server_info(self) -> utility_pb2.ServerInfo:
        """Model, devices, limits and serving state of the server."""
        request = utility_pb2.GetServerInfoRequest()
        return cast(
            utility_pb2.ServerInfo, self._stub.GetServerInfo(request, timeout=self.timeout_s)
        )

    def get_capacity(self) -> utility_pb2.Capacity:
        """Adapter slots: the maximum, how many are used and how many are free."""
        request = utility_pb2.GetCapacityRequest()
        return cast(utility_pb2.Capacity, self._stub.GetCapacity(request, timeout=self.timeout_s))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> UtilityClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()


def health(address: str, service: str = "", timeout_s: float = 5.0) -> HealthStatus:
    """grpc.health.v1.Health/Check of service ("" = the whole server) at address.

    Returns the status name, e.g. "SERVING". Raises grpc.RpcError when the call fails
    (UNAVAILABLE while the server is not listening, DEADLINE_EXCEEDED after timeout_s).
    """
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service=service)
        response = stub.Check(request, timeout=timeout_s)
    name = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
    return cast(HealthStatus, name)
