"""GRPOAdvantage: rewards minus their group's mean, scaled by the group's (or batch's) std.

Same arithmetic as Twinkle's torch version: float32, Bessel-corrected std (ddof=1), + 1e-8.
Rewards of one prompt's num_generations completions are consecutive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from twinkle.advantage.base import Advantage

EPS = 1e-8


class GRPOAdvantage(Advantage):

    def __call__(self, rewards: Any, num_generations: int = 1,
                 scale: Literal["group", "batch", "none"] = "group",
                 reward_weights: Sequence[float] | None = None, **kwargs: Any) -> np.ndarray:
        """rewards: [N] floats, or [N, F] per reward function (summed, or weighted by
        reward_weights). scale: 'group' divides by each group's std, 'batch' by the std of all
        rewards, 'none' only subtracts the group mean. With num_generations == 1 there are no
        groups: 'batch' standardises over the batch, 'none' subtracts the batch mean, 'group'
        returns the rewards unchanged."""
        if scale not in ("group", "batch", "none"):
            raise ValueError(f"scale: unknown '{scale}' (group | batch | none)")
        values = _as_array(rewards)
        if values.ndim == 2:
            weights = np.ones(values.shape[1], dtype=np.float32) if reward_weights is None else np.asarray(
                reward_weights, dtype=np.float32)
            values = (values * weights[None, :]).sum(axis=1, dtype=np.float32)
        elif values.ndim != 1:
            raise ValueError(f"rewards must be [N] or [N, F], got shape {values.shape}")
        if num_generations <= 0 or values.size % num_generations:
            raise ValueError(f"{values.size} rewards do not split into groups of num_generations={num_generations}")
        if num_generations == 1:
            if scale == "batch":
                std = values.std(ddof=1) if values.size > 1 else np.float32(1.0)
                return ((values - values.mean()) / (std + EPS)).astype(np.float32)
            if scale == "none":
                return (values - values.mean()).astype(np.float32)
            return values
        grouped = values.reshape(-1, num_generations)
        advantages = grouped - grouped.mean(axis=1, keepdims=True)
        if scale == "group":
            advantages = advantages / (grouped.std(axis=1, ddof=1, keepdims=True) + EPS)
        elif scale == "batch":
            advantages = advantages / (grouped.std(ddof=1) + EPS)
        return advantages.reshape(-1).astype(np.float32)


def _as_array(rewards: Any) -> np.ndarray:
    if hasattr(rewards, "detach"):  # a torch tensor, without importing torch
        rewards = rewards.detach().cpu().numpy()
    return np.asarray(rewards, dtype=np.float32)
