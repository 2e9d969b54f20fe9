"""Samples laid into rows of seq_len tokens on disk, and the dataset that reads a row back as a
batch.

A split is two memory-mapped files of rows x seq_len: the token ids, and one byte per token whose
bits say whether the loss counts it (TRAINED), whether it is a real token rather than padding (REAL)
and whether a sample starts there (START, from which the position ids reset). A row is read by its
index, so the data order and an exact resume are those of the text format's windows. Packed, a row
holds the samples in their order while the next one fits, then padding; unpacked, one sample and
padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch.utils.data import Dataset

TRAINED, REAL, START = 1, 2, 4


@dataclass
class Counts:
    """What the layout did to a split's samples, for the log and the cache's meta.json."""

    samples: int = 0
    truncated: int = 0
    dropped: int = 0
    rows: int = 0
    trained_tokens: int = 0


@dataclass
class RowWriter:
    """Appends samples to one split's two files, as whole rows."""

    folder: Path
    split: str
    seq_len: int
    packing: bool
    pad_id: int
    dtype: np.dtype
    counts: Counts = field(default_factory=Counts)

    def __post_init__(self) -> None:
        self.ids: BinaryIO = open(self.folder / f"{self.split}.bin", "wb")
        self.bits: BinaryIO = open(self.folder / f"{self.split}.mask.bin", "wb")
        self.row_ids: list[np.ndarray] = []
        self.row_bits: list[np.ndarray] = []
        self.used = 0

    def add(self, ids: np.ndarray, trained: np.ndarray) -> None:
        self.counts.samples += 1
        ids, trained, cut = fit(ids, trained, self.seq_len)
        self.counts.truncated += cut
        if not trained.any():
            self.counts.dropped += 1
            return
        if self.used + len(ids) > self.seq_len or (self.used and not self.packing):
            self._flush()
        bits = np.where(trained, TRAINED | REAL, REAL).astype(np.uint8)
        bits[0] |= START
        self.row_ids.append(ids)
        self.row_bits.append(bits)
        self.used += len(ids)
        self.counts.trained_tokens += int(trained.sum())

    def close(self) -> Counts:
        self._flush()
        for handle in (self.ids, self.bits):
            handle.flush()
            handle.close()
        return self.counts

    def _flush(self) -> None:
        if not self.used:
            return
        pad = self.seq_len - self.used
        ids = np.concatenate([*self.row_ids, np.full(pad, self.pad_id, dtype=np.int64)])
        bits = np.concatenate([*self.row_bits, np.zeros(pad, dtype=np.uint8)])
        if pad:
            bits[self.used] = START  # padding is a segment of its own: no sample attends to it
        self.ids.write(ids.astype(self.dtype).tobytes())
        self.bits.write(bits.tobytes())
        self.row_ids, self.row_bits, self.used = [], [], 0
        self.counts.rows += 1


def fit(ids: np.ndarray, trained: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray, int]:
    """A sample of at most seq_len tokens, cut from the prompt side: earlier turns and the start
    of the prompt go first; an answer longer than seq_len by itself keeps its beginning. Its first
    token is never a target (nothing of its own sample comes before it). Returns 1 if it was cut."""
    trained = trained.copy()
    cut = 0
    if len(ids) > seq_len:
        answers = np.flatnonzero(trained & ~np.concatenate([[False], trained[:-1]]))
        last_answer = int(answers[-1]) if len(answers) else len(ids)
        start = min(len(ids) - seq_len, max(last_answer - 1, 0))
        ids, trained, cut = ids[start : start + seq_len], trained[start : start + seq_len], 1
    trained[:1] = False
    return ids, trained, cut


class ChatRows(Dataset[dict[str, torch.Tensor]]):
    """Row i of a split: {input_ids, labels (-100 where the loss does not count), position_ids
    reset at each sample's start}, plus attention_mask (0 on padding) when rows are not packed:
    packed rows leave the mask out, so transformers builds a causal mask per sample from the
    position ids."""

    def __init__(self, folder: Path, split: str, dtype: str, seq_len: int, packing: bool) -> None:
        self.paths = folder / f"{split}.bin", folder / f"{split}.mask.bin"
        self.dtype, self.seq_len, self.packing = dtype, seq_len, packing
        self._maps: tuple[np.ndarray, np.ndarray] | None = None  # opened lazily: never pickled
        self._length = self.paths[1].stat().st_size // seq_len  # one byte a token

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self._maps is None:
            self._maps = (
                np.memmap(self.paths[0], dtype=self.dtype, mode="r"),
                np.memmap(self.paths[1], dtype=np.uint8, mode="r"),
            )
        window = slice(index * self.seq_len, (index + 1) * self.seq_len)
        ids = torch.from_numpy(self._maps[0][window].astype(np.int64))
        bits = torch.from_numpy(self._maps[1][window].astype(np.int64))
        starts = (bits & START) > 0
        segment_start = torch.cummax(torch.where(starts, torch.arange(self.seq_len), 0), 0).values
        row = {
            "input_ids": ids,
            "labels": torch.where((bits & TRAINED) > 0, ids, -100),
            "position_ids": torch.arange(self.seq_len) - segment_start,
        }
        if not self.packing:
            row["attention_mask"] = ((bits & REAL) > 0).long()
        return row
