"""Base classes: a Preprocessor maps a row to a Trajectory; a DataFilter keeps or drops a row."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twinkle.data_format import Trajectory


class Preprocessor:
    """Called with one row (a dict); returns a Trajectory, a list of them, or None to drop the row."""

    def __call__(self, row: Mapping[str, Any]) -> Trajectory | list[Trajectory] | None:
        raise NotImplementedError


class DataFilter:
    """Called with one row; True keeps it."""

    def __call__(self, row: Mapping[str, Any]) -> bool:
        raise NotImplementedError
