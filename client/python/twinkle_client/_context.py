"""The process's current client (set by init_twinkle_client), and server-provided tokenizers."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from twinkle.hub import HubNotAvailableError
from twinkle_client.errors import NotConnectedError

if TYPE_CHECKING:
    from twinkle_client.manager import TwinkleClient

_lock = threading.Lock()
_current: TwinkleClient | None = None


def set_current(client: TwinkleClient | None) -> None:
    global _current
    with _lock:
        _current = client


def current(required: bool = True) -> TwinkleClient | None:
    """The client init_twinkle_client made, else one made from TWINKLE_SERVER_URL / _TOKEN, else
    (for tinker-SDK scripts) from TINKER_BASE_URL / TINKER_API_KEY."""
    global _current
    with _lock:
        if _current is not None and not _current.closed:
            return _current
    from twinkle_client.manager import TwinkleClient

    url = os.environ.get("TWINKLE_SERVER_URL")
    if url:
        client = TwinkleClient(url, os.environ.get("TWINKLE_SERVER_TOKEN") or os.environ.get("TWINKLE_API_KEY"))
        set_current(client)
        return client
    tinker_url = os.environ.get("TINKER_BASE_URL")
    if tinker_url:  # the Tinker path (init_tinker_client): the same server answers gRPC too
        client = TwinkleClient(tinker_url, os.environ.get("TINKER_API_KEY"), create_session=False)
        set_current(client)
        return client
    if required:
        raise NotConnectedError("no twinkle-server connection: call init_twinkle_client(base_url, api_key) "
                                "first (or set TWINKLE_SERVER_URL; tinker-SDK scripts: init_tinker_client(base_url, ...))")
    return None


def cache_root() -> Path:
    configured = os.environ.get("TWINKLE_CLIENT_CACHE")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "twinkle-server-client"


def server_tokenizer_dir(model_id: str) -> Path:
    """A local directory with the server's tokenizer files (fetched once, cached by content)."""
    client = current(required=False)
    if client is None:
        raise HubNotAvailableError(
            f"model_id '{model_id}' is not a local directory, and no twinkle-server is connected to fetch its "
            "tokenizer from: call init_twinkle_client(base_url, api_key) before building the template (or set "
            "TWINKLE_SERVER_URL), or pass the path of a local tokenizer/model directory")
    return client.tokenizer_dir(model_id)


def write_tokenizer_files(files: dict[str, bytes], root: Path | None = None) -> Path:
    """files under root/<digest of their contents>, written atomically; returns that directory."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(name.encode() + b"\0" + files[name] + b"\0")
    target = (root or cache_root()) / "tokenizers" / digest.hexdigest()[:20]
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=target.parent))
    for name, content in files.items():
        if "/" in name or "\\" in name or name.startswith("."):
            raise ValueError(f"unexpected tokenizer file name from the server: {name!r}")
        (staging / name).write_bytes(content)
    try:
        os.rename(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not target.is_dir():
            raise
    return target
