"""Rewards: trajectories (with the sampled assistant turn) -> one float each."""

from twinkle.reward.base import Reward, last_assistant_text
from twinkle.reward.format_reward import FormatReward
from twinkle.reward.gsm8k import GSM8KAccuracyReward, GSM8KFormatReward

__all__ = ["FormatReward", "GSM8KAccuracyReward", "GSM8KFormatReward", "Reward", "last_assistant_text"]
