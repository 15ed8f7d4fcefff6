"""A Dataset over a TokenReader for test_data's DataLoader workers (module-level: spawn pickles it)."""

from __future__ import annotations

import os

import torch
from torch.utils.data import Dataset

from gradientmail.data import TokenReader


class ReaderDataset(Dataset):
    """Item ``i``: the pid of the worker, sequences ``[2i, 2i + 2)`` and the worker's ranged reads."""

    def __init__(self, reader: TokenReader, items: int) -> None:
        self.reader = reader
        self.items = items

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, int]:
        batch = self.reader.sequences(2 * index, 2)
        return os.getpid(), batch, self.reader.cache_stats().reads
