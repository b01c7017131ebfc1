"""Twinkle's twinkle_client.dataloader name: the local twinkle.dataloader.DataLoader."""

from twinkle.dataloader import DataLoader

__all__ = ["DataLoader"]
