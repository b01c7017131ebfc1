"""Metric base class: accumulate(...) many times, calculate() once, reset()."""

from __future__ import annotations

from typing import Any


class Metric:

    def __init__(self, device_mesh: Any = None, process_group: Any = None, **kwargs: Any) -> None:
        self.device_mesh = device_mesh
        self.process_group = process_group

    def reset(self) -> None:
        raise NotImplementedError

    def accumulate(self, inputs: Any = None, outputs: Any = None, **kwargs: Any) -> None:
        raise NotImplementedError

    def calculate(self) -> dict[str, Any]:
        raise NotImplementedError
