"""The built-in task's data when data.mix names weighted sources: each source prepared into the
cache as data.files is (rank 0 tokenizes, the others wait), then mixed (data/mix.py).

Each source is its own cache entry, keyed by its own files, so adding a source or changing a weight
tokenizes nothing again. Validation and test are each source's held-out fractions of its documents,
pooled into one split (every source's held-out windows, each evaluated once), so val_loss stays
comparable between runs with other weights.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch.distributed as dist
import xxhash
from torch.utils.data import ConcatDataset

from ..config import DataConfig
from ..data import corpus, prepare, sources
from ..data.cached import CachedReader
from ..data.mix import Mixture, Source
from ..data.tokens import TokenWindows
from ..foundation.errors import ConfigError


def prepare_sources(data: DataConfig) -> list[str]:
    """Rank 0's work: every source's cache entry (made where missing), once every source's files
    are found (a pattern that matches nothing is named before anything is tokenized)."""
    mixed = prepare.mixed_sources(data)
    for index, (name, settings) in enumerate(mixed):
        sources.find(settings.files, f"data.mix[{index}].files (source {name!r})")
    return [str(prepare.prepare(settings, data.prepare_workers)[0].folder)
            for _, settings in mixed]


def mixture_splits(data: DataConfig, folders: list[str], seed: int
                   ) -> tuple[Mixture, Any, Any, corpus.TokenFiles]:
    """(train: the mixture, val, test: pooled, the first source's entry for the vocabulary)."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if data.dispatch:  # rank 0 reads the whole mixture
        rank, world = 0, 1
    slots = world * max(data.num_workers, 1)
    prepared = [corpus.load(Path(folder)) for folder in folders]
    mixed: list[Source] = []
    held_out: dict[str, list[TokenWindows]] = {"val": [], "test": []}
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
        own_seed = xxhash.xxh3_64_intdigest(f"{seed}/{name}".encode()) % (1 << 31)
        reader = functools.partial(CachedReader, windows, own_seed)
        mixed.append(Source(name, float(entry["weight"]), reader))
        for split in held_out:
            if files.tokens[split] >= data.seq_len:  # a small source may hold out nothing
                held_out[split].append(
                    TokenWindows(str(files.path(split)), files.dtype, data.seq_len))
    if not held_out["val"] and data.val_fraction > 0:
        raise ConfigError(f"data.mix: no source holds out data.seq_len={data.seq_len} tokens for "
                          "validation; use more text, a larger data.val_fraction or a shorter "
                          "seq_len")
    val, test = (pooled(held_out[split]) for split in ("val", "test"))
    return Mixture(mixed, seed, rank, world), val, test, prepared[0]


def pooled(windows: list[TokenWindows]) -> ConcatDataset[Any] | None:
    return ConcatDataset(windows) if windows else None
