"""init_tinker_client: point the tinker SDK at a twinkle-server (settings only, no patching)."""

from __future__ import annotations

import os

# Twinkle's own variables, read when no argument is given and TINKER_* are unset.
_URL_FALLBACKS = ("TWINKLE_SERVER_URL",)
_KEY_FALLBACKS = ("TWINKLE_SERVER_TOKEN", "TWINKLE_API_KEY")


def init_tinker_client(base_url: str | None = None, api_key: str | None = None) -> dict[str, str]:
    """Set TINKER_BASE_URL and TINKER_API_KEY for tinker.ServiceClient.

    An argument wins; otherwise an existing TINKER_* value stays; otherwise TWINKLE_SERVER_URL /
    TWINKLE_SERVER_TOKEN are copied over. twinkle-server speaks the tinker protocol as the SDK
    expects, so nothing in the SDK is patched; a `base_url=`/`api_key=` passed to ServiceClient
    still takes precedence. Returns the values now in effect (the key masked).
    """
    _apply("TINKER_BASE_URL", base_url, _URL_FALLBACKS)
    _apply("TINKER_API_KEY", api_key, _KEY_FALLBACKS)
    key = os.environ.get("TINKER_API_KEY", "")
    return {
        "TINKER_BASE_URL": os.environ.get("TINKER_BASE_URL", ""),
        "TINKER_API_KEY": (key[:4] + "...") if key else "",
    }


def _apply(name: str, value: str | None, fallbacks: tuple[str, ...]) -> None:
    if value:
        os.environ[name] = value
        return
    if os.environ.get(name):
        return
    for fallback in fallbacks:
        if os.environ.get(fallback):
            os.environ[name] = os.environ[fallback]
            return
