"""Token datasets for causal language models: windows of a memory-mapped token file, or synthetic
ones."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset


class TokenWindows(Dataset[torch.Tensor]):
    """Non-overlapping windows of seq_len tokens from a memory-mapped token file."""

    def __init__(self, path: str, dtype: str, seq_len: int) -> None:
        self.path, self.dtype, self.seq_len = path, dtype, seq_len
        # opened lazily: a memmap must not be pickled into workers
        self._tokens: np.ndarray | None = None
        self._length = np.memmap(path, dtype=dtype, mode="r").shape[0] // seq_len

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = index * self.seq_len
        return torch.from_numpy(self._tokens[start : start + self.seq_len].astype(np.int64))


class SyntheticTokens(Dataset[torch.Tensor]):
    """Learnable random sequences (each token is the previous one plus a per-sample stride), for
    tests."""

    def __init__(self, samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        self.samples, self.seq_len, self.vocab_size, self.seed = samples, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start, stride = torch.randint(0, self.vocab_size, (2,), generator=gen).tolist()
        return (start + (stride % 7 + 1) * torch.arange(self.seq_len)) % self.vocab_size
