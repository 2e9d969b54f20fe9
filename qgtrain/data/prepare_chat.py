"""Preparing chat and prompt_completion files: records rendered, masked and laid into rows, per
split.

One process renders the records in the files' order, so the cache is the same whatever
data.prepare_workers says. Held-out records are drawn as the text format draws documents. At the end
the log says how many samples were cut to data.seq_len and how many were dropped for having no
answer token left.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..config import DataConfig
from ..foundation.errors import ConfigError
from . import chat, sources
from .corpus import SPLITS
from .progress import Progress
from .rows import Counts, RowWriter

if TYPE_CHECKING:
    from .prepare import Plan

CHAT_FORMAT_VERSION = 2  # text caches keep prepare.FORMAT_VERSION; this names the row layout
log = logging.getLogger("qgtrain")


def identity(data: DataConfig) -> dict[str, Any]:
    """What a chat cache's key adds to a text cache's: nothing at all for data.format text."""
    if data.format == "text":
        return {}
    return {
        "format": data.format,
        "fields": chat.fields(data),
        "version": CHAT_FORMAT_VERSION,
        "seq_len": data.seq_len,
        "packing": data.packing,
    }


def tokenize(todo: Plan, tmp: Path, split_of: Callable[[str, int], str]) -> None:
    """Write every split's rows and the entry's meta.json into tmp."""
    data, info = todo.data, todo.tokenizer
    render = chat.renderer(data, info.eos_id)
    dtype = np.dtype(np.uint16 if info.vocab_size <= 65535 else np.uint32)
    writers = {
        split: RowWriter(tmp, split, data.seq_len, data.packing, info.eos_id, dtype)
        for split in SPLITS
    }
    files_in = [file for _, file in todo.sources()]
    progress = Progress(sum(f.size for f in files_in), len(files_in))
    started = time.time()
    with progress:
        for split, ids, trained in _samples(todo, render, split_of, progress):
            writers[split].add(ids, trained)
            progress.add_document()
            progress.add_tokens(len(ids))
    counts = {split: writer.close() for split, writer in writers.items()}
    _report(counts, data.seq_len)
    meta = {
        "kind": "files",
        "format": data.format,
        "version": CHAT_FORMAT_VERSION,
        "dtype": dtype.name,
        "vocab_size": info.vocab_size,
        "eos_id": info.eos_id,
        "seq_len": data.seq_len,
        "packing": data.packing,
        "fields": chat.fields(data),
        "tokens": {s: c.rows * data.seq_len for s, c in counts.items()},
        "documents": {s: c.samples for s, c in counts.items()},
        "layout": {s: vars(c) for s, c in counts.items()},
        "tokenizer": data.tokenizer,
        "held_out": todo.held_out,
        "split_seed": data.split_seed,
        "sources": {split: [vars(f) for f in group] for split, group in todo.files.items()},
        "created": started,
        "seconds": round(time.time() - started, 3),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))


def _samples(
    todo: Plan, render: chat.Render, split_of: Callable[[str, int], str], progress: Progress
) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    for fixed_split, source in todo.sources():
        index = -1
        for index, (row, where, done) in enumerate(sources.records(source, chat.fields(todo.data))):
            ids, trained = render(row, where)
            yield fixed_split or split_of(source.path, index), ids, trained
            progress.read(done)
        if index < 0:
            raise ConfigError(
                f"{source.path}: the file holds no records; remove it from data.files"
            )
        if not source.unchanged():
            raise ConfigError(
                f"{source.path} changed while it was being tokenized; nothing was kept; "
                "run again once the file is complete"
            )
        progress.next_file(source.size)


def _report(counts: dict[str, Counts], seq_len: int) -> None:
    samples = sum(c.samples for c in counts.values())
    truncated = sum(c.truncated for c in counts.values())
    dropped = sum(c.dropped for c in counts.values())
    log.info(
        "data: %d of %d samples truncated to data.seq_len=%d (from the prompt side); %d dropped "
        "with no answer token left; rows: %s",
        truncated,
        samples,
        seq_len,
        dropped,
        ", ".join(f"{s} {c.rows}" for s, c in counts.items()),
    )
