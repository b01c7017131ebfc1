"""DataLoader: Twinkle's DataLoader for a single client process (no torch).

Batches are lists of rows (collate is the identity unless collate_fn is given). The loader
counts the samples it has handed out (get_state()['consumed_train_samples']), across epochs;
resume_from_checkpoint(n) makes a fresh loader continue exactly after the first n samples of
the same (seeded) order. Each pass over the data is one epoch; with shuffle=True epoch e uses
the permutation seeded by (seed, e).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

# torch.utils.data.DataLoader options Twinkle scripts pass that have no meaning here.
_IGNORED = frozenset({"num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "max_retries",
                      "worker_init_fn", "timeout", "multiprocessing_context", "generator"})


class DataLoader:
    """Args:
        dataset: anything with __len__ and __getitem__ (a twinkle Dataset, a list), or a
            function returning one (called once, as Twinkle does).
        batch_size: rows per batch. shuffle / seed: seeded order per epoch. drop_last: drop
            the last incomplete batch of each epoch.
        min_batch_size, device_mesh, remote_group: accepted for Twinkle compatibility; a
            single client process has one data-parallel rank.
    """

    def __init__(self, dataset: Any, batch_size: int = 1, shuffle: bool = False, seed: int = 42,
                 drop_last: bool = False, collate_fn: Callable[[list[Any]], Any] | None = None,
                 min_batch_size: int | None = None, device_mesh: Any = None, remote_group: str | None = None,
                 **kwargs: Any) -> None:
        unknown = set(kwargs) - _IGNORED
        if unknown:
            raise TypeError(f"DataLoader: unexpected argument(s) {sorted(unknown)}")
        if not hasattr(dataset, "__getitem__") and callable(dataset):
            dataset = dataset()
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError(f"DataLoader needs a sized, indexable dataset, got {type(dataset).__name__}")
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.collate_fn = collate_fn
        self.processor: Any = None
        self._consumed = 0

    def _epoch_length(self) -> int:
        n = len(self.dataset)
        return n - n % self.batch_size if self.drop_last else n

    def __len__(self) -> int:
        """Batches in one full epoch."""
        return math.ceil(self._epoch_length() / self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        """The row indices of an epoch, in the order they are served."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch (all of it unless resumed or stopped part-way)."""
        epoch_length = self._epoch_length()
        if epoch_length == 0:
            return
        epoch, offset = divmod(self._consumed, epoch_length)
        order = self.order(epoch)
        for start in range(offset, epoch_length, self.batch_size):
            indices = order[start:min(start + self.batch_size, epoch_length)]
            batch = [self.dataset[int(i)] for i in indices]
            self._consumed += len(indices)
            yield self.collate_fn(batch) if self.collate_fn is not None else batch

    def get_state(self) -> dict[str, int]:
        """{'consumed_train_samples': samples handed out so far, across epochs}."""
        return {"consumed_train_samples": self._consumed}

    def resume_from_checkpoint(self, consumed_train_samples: int | Mapping[str, Any]) -> None:
        """Continue after the first consumed_train_samples samples (a number, or the dict that
        get_state / model.resume_from_checkpoint return)."""
        if isinstance(consumed_train_samples, Mapping):
            consumed_train_samples = consumed_train_samples["consumed_train_samples"]
        value = int(consumed_train_samples)
        if value < 0:
            raise ValueError(f"consumed_train_samples must be >= 0, got {value}")
        self._consumed = value

    def skip_consumed_samples(self, consumed_train_samples: int) -> None:
        self.resume_from_checkpoint(consumed_train_samples)

    def set_processor(self, processor_cls: Any, **kwargs: Any) -> None:
        """Accepted for compatibility: batches stay lists of rows; the server pads."""
        self.processor = (processor_cls, kwargs)
