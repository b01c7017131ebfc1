"""Client-side components of ModelScope Twinkle, for training against twinkle-server.

Datasets, templates, dataloaders, preprocessors, rewards, advantages and metrics run on the
caller's machine; the model trains on the server (twinkle_client.model, or the tinker SDK after
init_tinker_client). Nothing here needs torch; templates need transformers.
"""

from __future__ import annotations

from twinkle._logging import get_logger
from twinkle._tinker import init_tinker_client

__version__ = "0.1.0"

__all__ = ["__version__", "get_logger", "init_tinker_client"]
