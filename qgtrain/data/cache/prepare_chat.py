"""Preparing chat and prompt_completion files: records rendered, masked and laid into rows, per
split.

One process reads the records in the files' order and data.prepare_workers processes render them
(the chat template and the tokenizer: the costly part), a batch of records at a time handed back in
order (ordered_pool.py); the rows are laid out in this process in that order, so the cache is byte
for byte the same whatever the number of workers. Held-out records are drawn as the text format
draws documents. At the end the log says how many samples were cut to data.seq_len and how many
were dropped for having no answer token left.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ...config import DataConfig
from ...foundation.errors import ConfigError
from .. import chat
from ..corpus import SPLITS
from ..files import sources
from ..rows import Counts, RowWriter
from .ordered_pool import OrderedPool
from .progress import Progress

if TYPE_CHECKING:
    from .prepare import CachePlan

CHAT_FORMAT_VERSION = 2  # text caches keep prepare.FORMAT_VERSION; this names the row layout
BATCH_RECORDS = 256  # records per batch a worker renders
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


def tokenize(
    todo: CachePlan, tmp: Path, split_of: Callable[[str, int], str], workers: int = 1
) -> None:
    """Write every split's rows and the entry's meta.json into tmp, rendered in `workers`
    processes."""
    data, info = todo.data, todo.tokenizer
    chat.render_batch(data, info.eos_id, [])  # no template: one line before any work (and cached)
    dtype = np.dtype(np.uint16 if info.vocab_size <= 65535 else np.uint32)
    writers = {
        split: RowWriter(tmp, split, data.seq_len, data.packing, info.eos_id, dtype)
        for split in SPLITS
    }
    files_in = [file for _, file in todo.sources()]
    progress = Progress(sum(f.size for f in files_in), len(files_in))
    started = time.time()
    render = functools.partial(chat.render_batch, data, info.eos_id)
    with OrderedPool(render, workers) as pool, progress:

        def write(done: Iterator[tuple[list[str], list[chat.Sample]]]) -> None:
            for splits, samples in done:
                for split, (ids, trained) in zip(splits, samples, strict=True):
                    writers[split].add(ids, trained)
                    progress.add_document()
                    progress.add_tokens(len(ids))

        for splits, records in _batches(todo, split_of, progress):
            write(pool.submit(splits, records))
        write(pool.finish())
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


def _batches(
    todo: CachePlan, split_of: Callable[[str, int], str], progress: Progress
) -> Iterator[tuple[list[str], list[tuple[dict[str, Any], str]]]]:
    """BATCH_RECORDS records at a time, in the files' order, each with its split and where it is."""
    splits: list[str] = []
    records: list[tuple[dict[str, Any], str]] = []
    for fixed_split, source in todo.sources():
        index = -1
        for index, (row, where, done) in enumerate(sources.records(source, chat.fields(todo.data))):
            splits.append(fixed_split or split_of(source.path, index))
            records.append((row, where))
            progress.read(done)
            if len(records) >= BATCH_RECORDS:
                yield splits, records
                splits, records = [], []
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
    if records:
        yield splits, records


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
