"""DatasetMeta: which data to load (Twinkle's fields)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass
class DatasetMeta:
    """dataset_id: a local file or directory (hub ids are refused; see twinkle.dataset.loading).
    subset_name / split: for directories holding several (datasets' save_to_disk DatasetDict,
    or files named by split). data_slice: row indices to keep, in that order; indices past the
    end wrap around, as in Twinkle."""

    dataset_id: str
    subset_name: str = "default"
    split: str = "train"
    data_slice: Iterable[int] | None = None

    def __post_init__(self) -> None:
        self.dataset_id = os.fspath(self.dataset_id)
        if self.data_slice is not None and not isinstance(self.data_slice, Iterable):
            raise ValueError("data_slice must be an iterable of row indices")

    def get_id(self) -> str:
        return self.dataset_id.replace(os.sep, "_").replace(".", "_") + ":" + self.subset_name + ":" + self.split

    def select(self, rows: list[Any]) -> list[Any]:
        """rows picked by data_slice (all of them when it is None)."""
        if self.data_slice is None:
            return rows
        if not rows:
            raise ValueError(f"data_slice given for an empty dataset ({self.dataset_id})")
        n = len(rows)
        return [rows[int(i) % n] for i in self.data_slice]
