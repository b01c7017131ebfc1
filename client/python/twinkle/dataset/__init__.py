"""Datasets read from local files, preprocessed, templated and encoded on the caller's machine."""

from twinkle.dataset.dataset import Dataset
from twinkle.dataset.meta import DatasetMeta
from twinkle.dataset.packing import PackingDataset
from twinkle.hub import HubNotAvailableError

__all__ = ["Dataset", "DatasetMeta", "HubNotAvailableError", "PackingDataset"]
