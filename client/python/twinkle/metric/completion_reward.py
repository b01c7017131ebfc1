"""CompletionRewardMetric: mean / std of each named reward and the mean completion length."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from twinkle.metric.base import Metric


class CompletionRewardMetric(Metric):
    """Keys: train/{name}_reward, train/{name}_reward_std (sample std, 0 for < 2 values),
    train/completion_length, and the profiling/ timings when given."""

    def __init__(self, device_mesh: Any = None, process_group: Any = None, **kwargs: Any) -> None:
        super().__init__(device_mesh, process_group, **kwargs)
        self.reset()

    def reset(self) -> None:
        self.rewards: dict[str, list[float]] = {}
        self.completion_lengths: list[int] = []
        self.generate_time: list[float] = []
        self.weight_sync_time: list[float] = []

    def accumulate(self, inputs: Any = None, outputs: Any = None, *,
                   rewards: Mapping[str, Sequence[float]] | None = None,
                   completion_lengths: Sequence[int] | None = None,
                   generate_time: float | None = None, weight_sync_time: float | None = None,
                   **kwargs: Any) -> None:
        for name, values in (rewards or {}).items():
            self.rewards.setdefault(name, []).extend(float(v) for v in values)
        self.completion_lengths.extend(int(n) for n in (completion_lengths or []))
        if generate_time is not None:
            self.generate_time.append(float(generate_time))
        if weight_sync_time is not None:
            self.weight_sync_time.append(float(weight_sync_time))

    def calculate(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.weight_sync_time:
            out["profiling/Time taken: move_model_to_sampler"] = _mean(self.weight_sync_time)
        if self.generate_time:
            out["profiling/Time taken: generate"] = _mean(self.generate_time)
        for name, values in self.rewards.items():
            out[f"train/{name}_reward"] = _mean(values)
            out[f"train/{name}_reward_std"] = statistics.stdev(values) if len(values) > 1 else 0.0
        if self.completion_lengths:
            out["train/completion_length"] = _mean(self.completion_lengths)
        return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else -1.0
