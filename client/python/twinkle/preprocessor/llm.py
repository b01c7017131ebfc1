"""Preprocessors for the datasets Twinkle's cookbooks use."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from twinkle.data_format import Message, Trajectory
from twinkle.preprocessor.base import Preprocessor


class SelfCognitionProcessor(Preprocessor):
    """swift/self-cognition rows (query, response with {{NAME}} / {{AUTHOR}}) -> a chat."""

    system_prompt = "You are a helpful assistant."

    def __init__(self, model_name: str, model_author: str) -> None:
        self.model_name = model_name
        self.model_author = model_author

    def _fill(self, text: str) -> str:
        return text.replace("{{NAME}}", self.model_name).replace("{{AUTHOR}}", self.model_author)

    def __call__(self, row: Mapping[str, Any]) -> Trajectory:
        return Trajectory(messages=[
            Message(role="system", content=self.system_prompt),
            Message(role="user", content=self._fill(str(row["query"]))),
            Message(role="assistant", content=self._fill(str(row["response"]))),
        ])


class AlpacaProcessor(Preprocessor):
    """instruction / input / output rows -> a chat."""

    def __call__(self, row: Mapping[str, Any]) -> Trajectory:
        instruction = row.get("instruction") or ""
        extra = row.get("input") or ""
        prompt = f"{instruction}\n{extra}" if extra else instruction
        return Trajectory(messages=[
            Message(role="user", content=prompt),
            Message(role="assistant", content=row.get("output") or ""),
        ])


class GSM8KProcessor(Preprocessor):
    """GSM8K rows (question, answer ending '#### N') -> a prompt; user_data holds the answer N."""

    system_prompt = (
        "You are a helpful math assistant. Solve the problem step by step. "
        "Show your reasoning in <think> </think> tags, then give the final "
        "numerical answer after ####.\n"
        "For example:\n<think> ... reasoning ... </think>\n#### 42"
    )

    @staticmethod
    def extract_ground_truth(answer: str) -> str:
        """The number after '####' (thousands separators removed), or ''."""
        match = re.search(r"####\s*([\-\d,\.]+)", answer)
        return match.group(1).replace(",", "").strip() if match else ""

    def __call__(self, row: Mapping[str, Any]) -> Trajectory:
        return Trajectory(
            messages=[
                Message(role="system", content=self.system_prompt),
                Message(role="user", content=str(row["question"])),
            ],
            user_data=[("ground_truth", self.extract_ground_truth(str(row.get("answer", ""))))],
        )


class CountdownProcessor(Preprocessor):
    """Countdown rows (nums, target) -> a prompt; user_data holds target and nums."""

    system_prompt = (
        "You are a helpful assistant. You first thinks about the reasoning process "
        "in the mind and then provides the user with the answer."
    )

    def __call__(self, row: Mapping[str, Any]) -> Trajectory:
        nums = list(row.get("nums", []))
        target = row.get("response", row.get("target", 0))
        query = (
            f"Using the numbers {nums}, create an equation that equals {target}.\n"
            "You can use basic arithmetic operations (+, -, *, /) and each number can only be used once.\n"
            "Show your work in <think> </think> tags. And return the final equation and answer in "
            "<answer> </answer> tags,\nfor example <answer> (1 + 2) / 3 * 4 = 4 </answer>."
        )
        return Trajectory(
            messages=[Message(role="system", content=self.system_prompt), Message(role="user", content=query)],
            user_data=[{"target": target, "nums": nums}],
        )
