"""Where a template's tokenizer comes from: a local directory or the server."""

from __future__ import annotations

import os
from pathlib import Path

from twinkle.hub import HubNotAvailableError, local_path, strip_hub_scheme


def tokenizer_dir(model_id: str | os.PathLike[str]) -> Path:
    """A local directory holding the tokenizer files for model_id.

    A local path is used as it is. Any other id (ms://..., hf://..., org/name) is the server's
    base model: its tokenizer files are fetched once through the twinkle client (connected by
    init_twinkle_client, or by TWINKLE_SERVER_URL) and cached on disk.
    """
    found = local_path(model_id)
    if found is not None:
        if found.is_file():
            found = found.parent
        return found
    try:
        from twinkle_client._context import server_tokenizer_dir
    except ImportError as exc:  # pragma: no cover - both packages ship together
        raise HubNotAvailableError(f"model_id '{model_id}' is not a local directory") from exc
    return server_tokenizer_dir(strip_hub_scheme(os.fspath(model_id)))
