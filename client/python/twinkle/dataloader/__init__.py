"""DataLoader: batches of dataset rows, with seeded shuffling and resumable position."""

from twinkle.dataloader.dataloader import DataLoader

__all__ = ["DataLoader"]
