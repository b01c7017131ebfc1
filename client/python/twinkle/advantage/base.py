"""Advantage base class (Twinkle's call signature)."""

from __future__ import annotations

from typing import Any

import numpy as np


class Advantage:
    """advantage(rewards, num_generations=1, scale='group') -> numpy float32 array (.tolist() works)."""

    def __call__(self, rewards: Any, num_generations: int = 1, scale: str = "group", **kwargs: Any) -> np.ndarray:
        raise NotImplementedError
