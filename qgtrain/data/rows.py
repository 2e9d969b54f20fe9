"""Samples laid into rows of seq_len tokens on disk, and the dataset that reads a row back as a
batch.

A split is two memory-mapped files of rows x seq_len: the token ids, and one byte per token whose
bits say whether the loss counts it (TRAINED), whether it is a real token rather than padding (REAL)
and whether a sample starts there (START, from which the position ids reset). A row is read by its
index, so the data order and an exact resume are those of the text format's windows. Packed, a row
holds the samples in their order while the next one fits, then padding; unpacked, one sample and
padding. A stream of chat records (chat_stream.py) lays its rows out with the same packer and
hands them to the model through the same batch_row, so a streamed and a cached run see the same
batches.
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


Row = tuple[np.ndarray, np.ndarray]  # a row's token ids (int64) and its bits, seq_len each


@dataclass
class RowPacker:
    """Samples laid into rows as they come, in memory: the one layout of the cache (RowWriter) and
    of a stream of chat records (chat_stream.py), so both train on the same rows."""

    seq_len: int
    packing: bool
    pad_id: int
    counts: Counts = field(default_factory=Counts)

    def __post_init__(self) -> None:
        self.row_ids: list[np.ndarray] = []
        self.row_bits: list[np.ndarray] = []
        self.used = 0

    def add(self, ids: np.ndarray, trained: np.ndarray) -> Row | None:
        """Lay a sample in; the row it closed (the one before it), if it closed one. A row is
        closed only by a sample that is kept, which then starts the next row."""
        self.counts.samples += 1
        ids, trained, cut = fit(ids, trained, self.seq_len)
        self.counts.truncated += cut
        if not trained.any():
            self.counts.dropped += 1
            return None
        done = None
        if self.used + len(ids) > self.seq_len or (self.used and not self.packing):
            done = self.flush()
        bits = np.where(trained, TRAINED | REAL, REAL).astype(np.uint8)
        bits[0] |= START
        self.row_ids.append(ids)
        self.row_bits.append(bits)
        self.used += len(ids)
        self.counts.trained_tokens += int(trained.sum())
        return done

    def flush(self) -> Row | None:
        """The row being built, padded to seq_len, if it holds a sample."""
        if not self.used:
            return None
        pad = self.seq_len - self.used
        ids = np.concatenate([*self.row_ids, np.full(pad, self.pad_id, dtype=np.int64)])
        bits = np.concatenate([*self.row_bits, np.zeros(pad, dtype=np.uint8)])
        if pad:
            bits[self.used] = START  # padding is a segment of its own: no sample attends to it
        self.row_ids, self.row_bits, self.used = [], [], 0
        self.counts.rows += 1
        return ids, bits


class RowWriter:
    """Appends samples to one split's two files, as whole rows."""

    def __init__(
        self, folder: Path, split: str, seq_len: int, packing: bool, pad_id: int, dtype: np.dtype
    ) -> None:
        self.packer, self.dtype = RowPacker(seq_len, packing, pad_id), dtype
        self.ids: BinaryIO = open(folder / f"{split}.bin", "wb")
        self.bits: BinaryIO = open(folder / f"{split}.mask.bin", "wb")

    def add(self, ids: np.ndarray, trained: np.ndarray) -> None:
        self._write(self.packer.add(ids, trained))

    def close(self) -> Counts:
        self._write(self.packer.flush())
        for handle in (self.ids, self.bits):
            handle.flush()
            handle.close()
        return self.packer.counts

    def _write(self, row: Row | None) -> None:
        if row is not None:
            self.ids.write(row[0].astype(self.dtype).tobytes())
            self.bits.write(row[1].tobytes())


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
        return batch_row(self._maps[0][window], self._maps[1][window], self.packing)


class ChatArray(Dataset[dict[str, torch.Tensor]]):
    """Rows held in memory (a stream's held-out records, chat_stream.py), read as ChatRows reads
    its files."""

    def __init__(self, rows: list[Row], seq_len: int, packing: bool) -> None:
        self.rows, self.seq_len, self.packing = rows, seq_len, packing

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return batch_row(*self.rows[index], self.packing)


def batch_row(ids: np.ndarray, bits: np.ndarray, packing: bool) -> dict[str, torch.Tensor]:
    """The batch a model receives for a row, wherever the row comes from (the cache's files, a
    stream, memory): {input_ids, labels, position_ids} and, unpacked, attention_mask."""
    seq_len = len(ids)
    tokens = torch.from_numpy(np.asarray(ids, dtype=np.int64))
    flags = torch.from_numpy(np.asarray(bits, dtype=np.int64))
    starts = (flags & START) > 0
    segment_start = torch.cummax(torch.where(starts, torch.arange(seq_len), 0), 0).values
    row = {
        "input_ids": tokens,
        "labels": torch.where((flags & TRAINED) > 0, tokens, -100),
        "position_ids": torch.arange(seq_len) - segment_start,
    }
    if not packing:
        row["attention_mask"] = ((flags & REAL) > 0).long()
    return row
