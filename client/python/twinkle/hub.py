"""Model and dataset ids: local paths versus hub ids (ms://, hf://, org/name).

This client never downloads from a hub: a hub id is either served by twinkle-server (model
tokenizers) or refused with HubNotAvailableError naming what to do instead.
"""

from __future__ import annotations

import os
from pathlib import Path

HUB_SCHEMES = ("ms://", "hf://", "modelscope://", "huggingface://")


class HubNotAvailableError(ValueError):
    """A hub id was given where only local files (or the server) can serve it."""


def strip_hub_scheme(identifier: str) -> str:
    """'ms://Qwen/Qwen3.5-4B' -> 'Qwen/Qwen3.5-4B' (other strings unchanged)."""
    for scheme in HUB_SCHEMES:
        if identifier.startswith(scheme):
            return identifier[len(scheme):]
    return identifier


def local_path(identifier: str | os.PathLike[str]) -> Path | None:
    """The existing local file or directory `identifier` names (~ expanded), else None."""
    text = os.fspath(identifier)
    if any(text.startswith(s) for s in HUB_SCHEMES):
        return None
    path = Path(text).expanduser()
    return path if path.exists() else None
