"""The built-in task's data when data.mix names weighted sources: each source prepared into the
cache as data.files is (rank 0 tokenizes, the others wait), or with data.stream each source read
while training as streamed data.files are (data/stream/filestream.py), then mixed
(data/mixture/mix.py).

Each source is its own cache entry, keyed by its own files, so adding a source or changing a weight
tokenizes nothing again. Validation and test are each source's held-out fractions of its documents,
pooled into one split (every source's held-out windows, each evaluated once), so val_loss stays
comparable between runs with other weights. A streamed source holds out the same fractions of its
documents (data/stream/heldout.py reads them into memory), pooled the same way. data.val_files
(data.test_files) beside the mix are that split instead, one fixed set to compare runs by: prepared
as an entry of their own (or read into memory, streamed), while no source holds out documents for
it (prepare.mixed_sources).

Every reading slot draws from every source, so a streamed source with fewer shards than slots (a
small curated file) is shared: slots read its lines or rows by a stride (filestream.deal); a part
that would hold no window for some slot is refused at the start, naming the file, rather than
found empty mid-run.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed as dist
import xxhash
from torch.utils.data import ConcatDataset, Dataset

from ..config import DataConfig
from ..data import corpus, tokenizer
from ..data.cache import prepare
from ..data.files import sources
from ..data.mixture.cached import CachedReader
from ..data.mixture.mix import Mixture, Source
from ..data.stream import filestream, heldout
from ..data.tokens import TokenWindows
from ..foundation.errors import ConfigError


def prepare_sources(data: DataConfig, shared: bool = False) -> list[str]:
    """Rank 0's work: every source's cache entry (made where missing, readable by the group if
    `shared`), once every source's files are found (a pattern that matches nothing is named before
    anything is tokenized)."""
    mixed = prepare.mixed_sources(data)
    for index, (name, settings) in enumerate(mixed):
        sources.find(settings.files, _key(index, name))
    named = prepare.held_out_files(data)  # data.val_files, data.test_files: after the sources
    for split, settings in named:
        sources.find(settings.files, f"data.{split}_files")
    return [
        str(prepare.prepare(settings, data.prepare_workers, shared)[0].folder)
        for _, settings in (*mixed, *named)
    ]


def mixture_splits(
    data: DataConfig, folders: list[str], seed: int
) -> tuple[Mixture, Any, Any, corpus.TokenFiles]:
    """(train: the mixture, val, test: pooled, the first source's entry for the vocabulary)."""
    rank, world, slots = reading(data)
    prepared = [corpus.load(Path(folder)) for folder in folders]
    mixed: list[Source] = []
    held_out: dict[str, list[Dataset[Any]]] = {"val": [], "test": []}
    for entry, files in zip(data.mix, prepared):
        name = entry["name"]
        windows = TokenWindows(str(files.path("train")), files.dtype, data.seq_len)
        if len(windows) < slots:
            raise ConfigError(
                f"data.mix: source {name!r} has {len(windows)} training windows of "
                f"data.seq_len={data.seq_len} tokens, fewer than the {slots} reading slots "
                f"({world} rank(s) x {max(data.num_workers, 1)} loader worker(s)); give it more "
                "text or use fewer data.num_workers"
            )
        reader = functools.partial(CachedReader, windows, source_seed(seed, name))
        mixed.append(Source(name, float(entry["weight"]), reader))
        for split in held_out:
            if files.tokens[split] >= data.seq_len:  # a small source may hold out nothing
                held_out[split].append(
                    TokenWindows(str(files.path(split)), files.dtype, data.seq_len)
                )
    for (split, _), files in zip(prepare.held_out_files(data), prepared[len(data.mix) :]):
        windows = TokenWindows(str(files.path("train")), files.dtype, data.seq_len)
        held_out[split].append(named_split(data, split, windows))
    val, test = pooled(data, held_out)
    return Mixture(mixed, seed, rank, world), val, test, prepared[0]


def streamed_splits(data: DataConfig, seed: int) -> tuple[Mixture, Any, Any, int]:
    """(train: the mixture of streamed sources, val, test: pooled, the vocabulary's size). Every
    source's files are found and cut before any is read for its held-out documents."""
    rank, world, slots = reading(data)
    plans = [
        filestream.plan(settings, source_seed(seed, name), _key(index, name))
        for index, (name, settings) in enumerate(prepare.mixed_sources(data))
    ]
    mixed: list[Source] = []
    held_out: dict[str, list[Dataset[Any]]] = {"val": [], "test": []}
    own = replace(data, val_files=(), test_files=())  # the named files are read once, below
    for index, (entry, plan) in enumerate(zip(data.mix, plans)):
        name = entry["name"]
        filestream.check(plan, world, slots)
        reader = functools.partial(filestream.slot_reader, plan)
        mixed.append(Source(name, float(entry["weight"]), reader))
        for split, windows in heldout.held_out(own, plan).items():
            if len(windows):  # a small source may hold out nothing
                held_out[split].append(windows)
    for split, _ in prepare.held_out_files(data):
        windows = heldout.from_files(data, split, plans[0])
        held_out[split].append(named_split(data, split, windows))
    val, test = pooled(data, held_out)
    vocab = tokenizer.describe(data.tokenizer).vocab_size
    return Mixture(mixed, seed, rank, world), val, test, vocab


def reading(data: DataConfig) -> tuple[int, int, int]:
    """(this rank, the ranks that read, their reading slots: ranks x loader workers)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if data.dispatch:  # rank 0 reads the whole mixture
        rank, world = 0, 1
    return rank, world, world * max(data.num_workers, 1)


def source_seed(seed: int, name: str) -> int:
    """A source's own seed: its order of samples does not change when another source is added."""
    return xxhash.xxh3_64_intdigest(f"{seed}/{name}".encode()) % (1 << 31)


def pooled(
    data: DataConfig, held_out: dict[str, list[Dataset[Any]]]
) -> tuple[ConcatDataset[Any] | None, ConcatDataset[Any] | None]:
    """(val, test): every source's held-out windows together."""
    if not held_out["val"] and data.val_fraction > 0:
        raise ConfigError(
            f"data.mix: no source holds out data.seq_len={data.seq_len} tokens for "
            "validation; use more text, a larger data.val_fraction or a shorter "
            "seq_len"
        )
    return _joined(held_out["val"]), _joined(held_out["test"])


def named_split(data: DataConfig, split: str, windows: Dataset[Any]) -> Dataset[Any]:
    """The held-out set data.val_files (data.test_files) names beside the mix, or one line saying
    it holds not one window."""
    if not len(windows):  # type: ignore[arg-type]
        raise ConfigError(
            f"data.{split}_files: fewer than data.seq_len={data.seq_len} tokens"
            + (f" in the first {heldout.HELD_OUT_BYTES >> 20} MB read" if data.stream else "")
            + "; use more text or a shorter seq_len"
        )
    return windows


def _joined(windows: list[Dataset[Any]]) -> ConcatDataset[Any] | None:
    return ConcatDataset(windows) if windows else None


def _key(index: int, name: str) -> str:
    return f"data.mix[{index}].files (source {name!r})"
