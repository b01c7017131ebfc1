"""Twinkle's twinkle_client.dataset names. Data stays on the client (twinkle-server takes token
ids only), so these are the local twinkle.dataset classes, used exactly the same way."""

from twinkle.dataset import Dataset, DatasetMeta, PackingDataset

__all__ = ["Dataset", "DatasetMeta", "PackingDataset"]
