"""Reward base class (Twinkle's call signature) and the helper every reward uses."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class Reward:
    """reward(trajectories, ground_truths=None, **kwargs) -> list of floats, one per trajectory."""

    def __call__(self, trajectories: Sequence[Mapping[str, Any]], ground_truths: Any = None,
                 **kwargs: Any) -> list[float]:
        raise NotImplementedError


def last_assistant_text(trajectory: Mapping[str, Any]) -> str:
    """The content of the trajectory's last assistant message ('' when there is none)."""
    for message in reversed(list(trajectory.get("messages") or [])):
        if message.get("role") == "assistant":
            content = message.get("content") or ""
            if isinstance(content, list):  # multimodal-style parts
                return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
            return str(content)
    return ""
