"""GSM8K rewards: answer accuracy against user_data's ground_truth, and answer format.

The answer is the content of the last \\boxed{...} (nested braces allowed) in the last 500
characters of the completion, else the last '#### N' there.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.data_format import user_data_get
from twinkle.reward.base import Reward, last_assistant_text

_HASHES = re.compile(r"####\s*([\-\d,\.\s]+)")
_HASHES_PRESENT = re.compile(r"####\s*[\-\d,\.]+")
_TAIL = 500


def last_boxed(text: str) -> str:
    """The stripped content of the last \\boxed{...}, or '' (unbalanced braces count as none)."""
    index = text.rfind("\\boxed{")
    if index < 0:
        return ""
    start = j = index + len("\\boxed{")
    depth = 1
    while j < len(text) and depth:
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        j += 1
    return text[start:j - 1].strip() if depth == 0 else ""


class GSM8KAccuracyReward(Reward):
    """1.0 when the extracted answer equals the ground truth (numerically when both parse)."""

    @staticmethod
    def extract_answer(completion: str) -> str:
        text = completion[-_TAIL:]
        boxed = last_boxed(text)
        if boxed:
            return boxed.replace(",", "").replace(" ", "").strip()
        matches = _HASHES.findall(text)
        return matches[-1].replace(",", "").replace(" ", "").strip() if matches else ""

    def __call__(self, trajectories: Sequence[Mapping[str, Any]], ground_truths: Any = None,
                 **kwargs: Any) -> list[float]:
        rewards = []
        for trajectory in trajectories:
            predicted = self.extract_answer(last_assistant_text(trajectory))
            truth = str(user_data_get(trajectory.get("user_data"), "ground_truth", "") or "")
            rewards.append(1.0 if predicted and truth and _same(predicted, truth) else 0.0)
        return rewards


class GSM8KFormatReward(Reward):
    """1.0 when the completion gives an answer as \\boxed{...} or '#### N'."""

    def __call__(self, trajectories: Sequence[Mapping[str, Any]], ground_truths: Any = None,
                 **kwargs: Any) -> list[float]:
        out = []
        for trajectory in trajectories:
            completion = last_assistant_text(trajectory)
            out.append(1.0 if last_boxed(completion) or _HASHES_PRESENT.search(completion) else 0.0)
        return out


def _same(predicted: str, truth: str) -> bool:
    try:
        return abs(float(predicted) - float(truth)) < 1e-5
    except (ValueError, OverflowError):
        return predicted == truth
