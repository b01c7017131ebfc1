"""FormatReward: 1.0 when the completion has both <think>...</think> and <answer>...</answer>."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.reward.base import Reward, last_assistant_text

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_ANSWER = re.compile(r"<answer>.*?</answer>", re.DOTALL)


class FormatReward(Reward):

    @staticmethod
    def format_reward(completion: str) -> float:
        return 1.0 if _THINK.search(completion) and _ANSWER.search(completion) else 0.0

    def __call__(self, trajectories: Sequence[Mapping[str, Any]], ground_truths: Any = None,
                 **kwargs: Any) -> list[float]:
        return [self.format_reward(last_assistant_text(t)) for t in trajectories]
