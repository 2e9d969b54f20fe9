"""Data files tokenized once into a cache that every later job, rank and requeue reuses.

A cache entry is named by a key of everything that decides its bytes: each file's path, size and
modification time, the tokenizer, the text field and the split settings. A changed file gives a new
key, so a stale cache is never trained on; it is prepared again. The entry is written to a temporary
folder and renamed into place (a job killed mid-way leaves no entry a later job would trust), under
a lock file so that concurrent jobs wait for one another instead of doing the work twice (where the
filesystem has no locks, the rename alone keeps them from corrupting each other).

Documents stream through: the main process reads them and groups about a megabyte of text per batch,
worker processes tokenize the batches (ordered_pool.py), and the results are written in order, so
the output does not depend on the number of workers and memory stays bounded by the batches in
flight.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import xxhash

from ...config import DataConfig
from ...foundation.errors import ConfigError
from .. import tokenizer
from ..corpus import SPLITS, TokenFiles, load
from ..files import sources
from . import prepare_chat
from .lock import entry_lock, is_ready, private_temp_dir, seal
from .ordered_pool import OrderedPool
from .progress import Progress

FORMAT_VERSION = 1
BATCH_BYTES = 1 << 20
log = logging.getLogger("qgtrain")


@dataclass(frozen=True)
class CachePlan:
    """What one cache entry is made of: the files of each split, and the fractions held out of
    data.files."""

    folder: Path
    files: dict[str, list[sources.SourceFile]]
    held_out: dict[str, float]
    data: DataConfig
    tokenizer: tokenizer.TokenizerInfo

    def sources(self) -> Iterator[tuple[str | None, sources.SourceFile]]:
        """(split, file), where split None means the file's documents are divided by the held-out
        fractions."""
        for split, files in self.files.items():
            for file in files:
                yield (None if split == "train" else split), file


def plan(data: DataConfig) -> CachePlan:
    files = {"train": sources.find(data.files, "data.files")}
    held_out = {}
    for split in ("val", "test"):
        patterns = getattr(data, f"{split}_files")
        files[split] = sources.find(patterns, f"data.{split}_files") if patterns else []
        held_out[split] = 0.0 if patterns else getattr(data, f"{split}_fraction")
    info = tokenizer.describe(data.tokenizer)
    identity = {
        "version": FORMAT_VERSION,
        "tokenizer": info.fingerprint,
        "text_field": data.text_field,
        "held_out": held_out,
        "split_seed": data.split_seed,
        "files": {
            split: [(f.path, f.size, f.mtime_ns) for f in group] for split, group in files.items()
        },
        **prepare_chat.identity(data),
    }
    key = xxhash.xxh3_128_hexdigest(json.dumps(identity, sort_keys=True).encode())[:24]
    return CachePlan(Path(data.cache_dir).resolve() / f"files-{key}", files, held_out, data, info)


def prepare_configured(
    data: DataConfig, workers: int | None, shared: bool = False
) -> tuple[TokenFiles, bool]:
    """`qgtrain data prepare`: the configured data tokenized into its cache, and whether this made
    it. `shared` (logging.shared): the group may read the entry."""
    if data.name == "corpus":
        from .. import corpus

        return corpus.prepare(data, shared), True
    if data.name != "files":
        raise ConfigError(
            f"data.name: '{data.name}' has nothing to prepare; use data.name: files (or corpus)"
        )
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers: {workers} is below 1")
    return prepare(data, workers or data.prepare_workers, shared)


def mixed_sources(data: DataConfig) -> list[tuple[str, DataConfig]]:
    """Each data.mix source's name and the settings that prepare it, as data.files would be. A split
    that data.val_files (data.test_files) names is read from those files alone, as beside
    data.files: no source holds out documents for it; the other split keeps its fraction."""
    own = replace(
        data,
        val_files=(),
        test_files=(),
        mix=(),
        val_fraction=0.0 if data.val_files else data.val_fraction,
        test_fraction=0.0 if data.test_files else data.test_fraction,
    )
    return [(source["name"], replace(own, files=_patterns(source["files"]))) for source in data.mix]


def held_out_files(data: DataConfig) -> list[tuple[str, DataConfig]]:
    """Beside data.mix, each split that data.val_files or data.test_files names, with the settings
    that prepare its files as an entry of their own: all in its train split, which is then read
    as the held-out set (one entry whatever the sources: adding a source tokenizes it again
    nowhere)."""
    alone = replace(data, val_files=(), test_files=(), val_fraction=0.0, test_fraction=0.0, mix=())
    return [
        (split, replace(alone, files=getattr(data, f"{split}_files")))
        for split in ("val", "test")
        if data.mix and getattr(data, f"{split}_files")
    ]


def _patterns(files: str | list[str]) -> tuple[str, ...]:
    return (files,) if isinstance(files, str) else tuple(files)


def prepare(data: DataConfig, workers: int = 0, shared: bool = False) -> tuple[TokenFiles, bool]:
    """The cache entry for data.files, and whether this call made it (False: it was already
    there)."""
    todo = plan(data)
    if is_ready(todo.folder):
        return load(todo.folder), False
    todo.folder.parent.mkdir(parents=True, exist_ok=True)
    with entry_lock(todo.folder, data.prepare_timeout_s) as locked:
        if is_ready(todo.folder):
            return load(todo.folder), False
        if locked:  # whoever left a temporary folder behind is gone: the lock was free
            for leftover in todo.folder.parent.glob(f"{todo.folder.name}.tmp-*"):
                _remove(leftover)
        tmp = private_temp_dir(todo.folder)
        try:
            _tokenize(todo, tmp, workers or len(os.sched_getaffinity(0)))
            seal(tmp, shared)
            try:
                tmp.rename(todo.folder)
            except OSError:  # another job without the lock finished first: its entry is identical
                pass
            _fsync(todo.folder.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return load(todo.folder), True


def _remove(leftover: Path) -> None:
    """A leftover temporary folder goes; a link there (planted in a shared cache) goes, never
    what it names."""
    if leftover.is_symlink() or not leftover.is_dir():
        leftover.unlink(missing_ok=True)
    else:
        shutil.rmtree(leftover, ignore_errors=True)


def _tokenize(todo: CachePlan, tmp: Path, workers: int) -> None:
    if todo.data.format != "text":
        seed, held_out = todo.data.split_seed, todo.held_out
        prepare_chat.tokenize(
            todo, tmp, lambda path, index: _held_out_split(seed, path, index, held_out), workers
        )
        for path in (*sorted(tmp.iterdir()), tmp):
            _fsync(path)
        return
    info = todo.tokenizer
    dtype = np.dtype(np.uint16 if info.vocab_size <= 65535 else np.uint32)
    files = {split: open(tmp / f"{split}.bin", "wb") for split in SPLITS}
    tokens, documents = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
    files_in = [file for _, file in todo.sources()]
    progress = Progress(sum(f.size for f in files_in), len(files_in))
    started = time.time()
    encode = functools.partial(tokenizer.encode_pieces, todo.data.tokenizer, info.eos_id)
    byte = todo.data.tokenizer == tokenizer.BYTE  # faster in this process than sent to another
    with OrderedPool(encode, 1 if byte else workers) as encoder, progress:

        def write(done: Iterator[tuple[str, np.ndarray]]) -> None:
            for split, ids in done:
                files[split].write(ids.astype(dtype).tobytes())
                tokens[split] += len(ids)
                progress.add_tokens(len(ids))

        for split, texts, ends in _batches(todo, documents, progress):
            write(encoder.submit(split, texts, ends))
        write(encoder.finish())
    for handle in files.values():
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
    meta = {
        "kind": "files",
        "version": FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": info.vocab_size,
        "eos_id": info.eos_id,
        "tokens": tokens,
        "documents": documents,
        "tokenizer": todo.data.tokenizer,
        "text_field": todo.data.text_field,
        "held_out": todo.held_out,
        "split_seed": todo.data.split_seed,
        "sources": {split: [vars(f) for f in group] for split, group in todo.files.items()},
        "created": started,
        "seconds": round(time.time() - started, 3),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    _fsync(tmp / "meta.json")
    _fsync(tmp)


def _batches(
    todo: CachePlan, documents: dict[str, int], progress: Progress
) -> Iterator[tuple[str, list[str], list[bool]]]:
    """About BATCH_BYTES of text at a time for one split, in the files' order."""
    pending: dict[str, tuple[list[str], list[bool], int]] = {s: ([], [], 0) for s in SPLITS}
    seed = todo.data.split_seed
    for fixed_split, source in todo.sources():
        for piece, done in sources.pieces(source, todo.data.text_field):
            split = fixed_split or _held_out_split(seed, source.path, piece.document, todo.held_out)
            texts, ends, size = pending[split]
            texts.append(piece.text)
            ends.append(piece.ends_document)
            size += len(piece.text)
            if piece.ends_document:
                documents[split] += 1
                progress.add_document()
            progress.read(done)
            if size >= BATCH_BYTES:
                yield split, texts, ends
                texts, ends, size = [], [], 0
            pending[split] = (texts, ends, size)
        if not source.unchanged():
            raise ConfigError(
                f"{source.path} changed while it was being tokenized; nothing was kept; run again "
                "once the file is complete"
            )
        progress.next_file(source.size)
    for split, (texts, ends, _) in pending.items():
        if texts:
            yield split, texts, ends


def _held_out_split(seed: int, path: str, document: int, held_out: dict[str, float]) -> str:
    """A document's split, from a hash of the seed and its place (the file's path as given, and the
    document's index in it): the same on every run and node that reads the files at the same
    paths."""
    draw = xxhash.xxh3_64_intdigest(f"{seed}\0{path}\0{document}".encode()) / 2.0**64
    if draw < held_out["val"]:
        return "val"
    return "test" if draw < held_out["val"] + held_out["test"] else "train"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
