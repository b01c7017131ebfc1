"""Python SDK for twinkle-server, with ModelScope Twinkle's twinkle_client API.

    from twinkle_client import init_twinkle_client
    from twinkle_client.model import MultiLoraTransformersModel

    client = init_twinkle_client(base_url="http://127.0.0.1:8000", api_key="...")
    model = MultiLoraTransformersModel(model_id="ms://Qwen/Qwen3.5-4B")

Lower level: UtilityClient and health() (gRPC addresses), the generated stubs in
twinkle_client._proto.
"""

from __future__ import annotations

__version__ = "0.2.0"

from pathlib import Path
from typing import Any

from twinkle import init_tinker_client
from twinkle_client import _context
from twinkle_client._rpc import RetryPolicy
from twinkle_client.errors import (
    EndpointDiscoveryError,
    NotConnectedError,
    ServerError,
    TwinkleClientError,
    UnsupportedFeatureError,
)
from twinkle_client.manager import TwinkleClient
from twinkle_client.utility import HealthStatus, UtilityClient, health


def init_twinkle_client(base_url: str | None = None, api_key: str | None = None, *,
                        root_certificates: bytes | str | Path | None = None, **kwargs: Any) -> TwinkleClient:
    """Connect to twinkle-server and make the connection current for models and samplers.

    base_url: the server's HTTP base URL (http://127.0.0.1:8000; the gRPC endpoint is found
    through GET /api/v1/twinkle/endpoints), or grpc://host:port / grpcs://host:port. Default:
    TWINKLE_SERVER_URL. api_key: default TWINKLE_SERVER_TOKEN. Other options: see TwinkleClient.
    """
    previous = _context._current
    client = TwinkleClient(base_url, api_key, root_certificates=root_certificates, **kwargs)
    _context.set_current(client)
    if previous is not None and previous is not client:
        previous.close()
    return client


__all__ = [
    "EndpointDiscoveryError",
    "HealthStatus",
    "NotConnectedError",
    "RetryPolicy",
    "ServerError",
    "TwinkleClient",
    "TwinkleClientError",
    "UnsupportedFeatureError",
    "UtilityClient",
    "__version__",
    "health",
    "init_tinker_client",
    "init_twinkle_client",
]
