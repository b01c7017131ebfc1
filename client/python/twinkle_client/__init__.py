"""Python client for twinkle-server."""

from __future__ import annotations

__version__ = "0.1.0"

from twinkle_client.utility import HealthStatus, UtilityClient, health

__all__ = ["HealthStatus", "UtilityClient", "__version__", "health"]
