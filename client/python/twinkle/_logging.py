"""get_logger: Twinkle's logger helper (a stdlib logger with a plain handler)."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "[%(levelname)s:%(name)s] %(message)s"


def get_logger(name: str = "twinkle", level: int | str | None = None) -> logging.Logger:
    """A logger writing to stderr; level from the argument, else TWINKLE_LOG_LEVEL, else INFO."""
    logger = logging.getLogger(name)
    if not any(getattr(h, "_twinkle", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler._twinkle = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    chosen = level if level is not None else os.environ.get("TWINKLE_LOG_LEVEL", "INFO")
    logger.setLevel(chosen.upper() if isinstance(chosen, str) else chosen)
    return logger
