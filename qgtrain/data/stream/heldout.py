"""The validation and test splits of streamed data files, read into memory when the task is built.

A stream has no cache to hold them, and evaluation needs a fixed set it can read exactly once over
all ranks, so each split is made small and kept in memory on every rank (the same on each: it is
read the same way): data.val_files (data.test_files) read from their start, or the documents
filestream.py holds out of data.files, looked for in the first shards of the files in their
order. Either way reading stops after HELD_OUT_BYTES of text, so a stream starts in about the same
time however large the files are; a held-out fraction's documents beyond that are still never
trained on, only not evaluated.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from ...config import DataConfig
from .. import tokenizer
from ..files import shards, sources
from .plan import StreamPlan

HELD_OUT_BYTES = 8 << 20


class TokenArray(Dataset[torch.Tensor]):
    """Non-overlapping windows of seq_len tokens of an array in memory."""

    def __init__(self, tokens: np.ndarray, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return len(self.tokens) // self.seq_len

    def __getitem__(self, index: int) -> torch.Tensor:
        start = index * self.seq_len
        return torch.from_numpy(self.tokens[start : start + self.seq_len].astype(np.int64))


def held_out(data: DataConfig, plan: StreamPlan) -> dict[str, TokenArray]:
    """{val, test}: each from its own files, or from the documents held out of data.files."""
    texts: dict[str, list[tuple[str, bool]]] = {"val": [], "test": []}
    from_files = [s for s in texts if getattr(data, f"{s}_files")]
    for split in from_files:
        texts[split] = _file_texts(data, split)
    if len(from_files) < 2:
        for unit in _read(list(plan.shards), data.text_field):
            if (split := plan.split_of(unit.path, unit.key)) not in from_files and split != "train":
                texts[split].append((unit.text, unit.ends))
    return {split: TokenArray(_encode(plan, found), data.seq_len) for split, found in texts.items()}


def from_files(data: DataConfig, split: str, plan: StreamPlan) -> TokenArray:
    """The split that data.val_files or data.test_files names, beside a streamed data.mix (`plan`:
    any source's, for the tokenizer they share)."""
    return TokenArray(_encode(plan, _file_texts(data, split)), data.seq_len)


def _file_texts(data: DataConfig, split: str) -> list[tuple[str, bool]]:
    found = shards.cut(sources.find(getattr(data, f"{split}_files"), f"data.{split}_files"))
    return [(unit.text, unit.ends) for unit in _read(found, data.text_field)]


class _Found(NamedTuple):
    text: str
    ends: bool
    key: int
    path: str


def _read(found: list[shards.Shard], text_field: str) -> list[_Found]:
    """The units of the shards in order until HELD_OUT_BYTES of text, each with its file."""
    units: list[_Found] = []
    size = 0
    for shard in found:
        for unit in shards.units(shard, text_field):
            if size >= HELD_OUT_BYTES:
                return units
            size += len(unit.text)
            if unit.text or (unit.ends and shard.source.kind == "text"):
                units.append(_Found(unit.text, unit.ends, unit.key, shard.source.path))
    return units


def _encode(plan: StreamPlan, texts: list[tuple[str, bool]]) -> np.ndarray:
    if not texts:
        return np.zeros(0, dtype=np.uint32)
    return tokenizer.encode_pieces(
        plan.tokenizer, plan.eos_id, [t for t, _ in texts], [e for _, e in texts]
    )
