"""Client-side metrics."""

from twinkle.metric.base import Metric
from twinkle.metric.completion_reward import CompletionRewardMetric

__all__ = ["CompletionRewardMetric", "Metric"]
