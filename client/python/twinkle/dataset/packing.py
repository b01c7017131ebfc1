"""PackingDataset: encoded rows bin-packed into rows of at most max_length tokens.

Each packed row concatenates whole sequences; position_ids restart at 0 at each one, which is
how twinkle_client.model splits them again before sending (the server batches sequences
itself, so packing changes grouping, never the loss).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from twinkle.dataset.dataset import Dataset
from twinkle.dataset.loading import Row
from twinkle.dataset.meta import DatasetMeta

PACKED_KEYS = ("input_ids", "labels", "attention_mask", "position_ids")


class PackingDataset(Dataset):
    """A Dataset with pack_dataset(): call it after encode()."""

    def __init__(self, dataset_meta: DatasetMeta, packing_num_proc: int = 1, **kwargs: Any) -> None:
        super().__init__(dataset_meta, **kwargs)
        self.packing_num_proc = packing_num_proc

    def pack_dataset(self, max_length: int | None = None) -> None:
        """Pack the encoded rows, first-fit by decreasing length (stable, deterministic), into
        rows of at most max_length tokens (default: the template's max_length)."""
        limit = max_length or (self.template.max_length if self.template is not None else None)
        if not limit:
            raise ValueError("pack_dataset needs max_length (or a template with max_length)")
        rows = self.dataset
        for row in rows:
            if "input_ids" not in row or "labels" not in row:
                raise ValueError("pack_dataset needs encoded rows: call encode() first")
        lengths = [len(r["input_ids"]) for r in rows]
        too_long = [n for n in lengths if n > limit]
        if too_long:
            raise ValueError(f"{len(too_long)} rows are longer than max_length {limit} (longest {max(too_long)})")
        order = sorted(range(len(rows)), key=lambda i: (-lengths[i], i))
        bins: list[list[int]] = []
        room: list[int] = []
        for i in order:
            for b, free in enumerate(room):
                if lengths[i] <= free:
                    bins[b].append(i)
                    room[b] -= lengths[i]
                    break
            else:
                bins.append([i])
                room.append(limit - lengths[i])
        self._store_current([_pack([rows[i] for i in members]) for members in bins])


def _pack(rows: list[Row]) -> Row:
    packed: Row = {}
    for key in PACKED_KEYS:
        parts = []
        for row in rows:
            if key == "position_ids":
                parts.append(np.arange(len(row["input_ids"]), dtype=np.int64))
            elif key == "attention_mask":
                parts.append(np.ones(len(row["input_ids"]), dtype=np.int64))
            else:
                parts.append(np.asarray(row[key], dtype=np.int64))
        packed[key] = np.concatenate(parts)
    packed["length"] = int(len(packed["input_ids"]))
    return packed
