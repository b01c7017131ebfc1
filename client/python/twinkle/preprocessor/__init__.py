"""Preprocessors: raw dataset rows -> Trajectory (Twinkle's names and outputs)."""

from twinkle.preprocessor.base import DataFilter, Preprocessor
from twinkle.preprocessor.llm import (
    AlpacaProcessor,
    CountdownProcessor,
    GSM8KProcessor,
    SelfCognitionProcessor,
)

__all__ = [
    "AlpacaProcessor",
    "CountdownProcessor",
    "DataFilter",
    "GSM8KProcessor",
    "Preprocessor",
    "SelfCognitionProcessor",
]
