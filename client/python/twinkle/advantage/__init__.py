"""Advantage estimators for RL: rewards -> per-sample advantages (numpy arrays)."""

from twinkle.advantage.base import Advantage
from twinkle.advantage.grpo import GRPOAdvantage

__all__ = ["Advantage", "GRPOAdvantage"]
