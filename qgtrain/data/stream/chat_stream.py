"""Chat and prompt_completion records streamed (data.stream with data.format chat or
prompt_completion): rendered, masked and packed in the loader workers, no cache.

Why this shape: the cache's rows are made by chat.py's renderer and rows.py's packer, and a stream
makes its rows with the same two, so a streamed run trains on the rows a cached run of the same
records would (the same labels, position ids and attention mask), only packed within a shard
rather than across the files. A row ends only when the next kept record does not fit (rows.py),
and that record starts the next row; so the position saved with a row is that record (its index
and byte, a seek where the file is seekable) and a resume renders and packs again from it, exactly
as the uninterrupted run did. A shard's last row is padded (the cache pads its last row too).

Held-out records are drawn by the hash the text stream uses (plan.split_of: the file and
the record's byte offset, or its index where the file is not seekable) and read into memory when
the task is built, up to heldout.HELD_OUT_BYTES, as streamed text's are.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import get_worker_info

from ...config import DataConfig
from ...foundation.errors import ConfigError
from ...runtime import comms
from .. import chat
from ..files import shards, sources
from ..rows import ChatArray, Row, RowPacker, batch_row
from .heldout import HELD_OUT_BYTES
from .plan import StreamPlan

SPLITS = ("val", "test")


def rows(
    plan: StreamPlan, shard: shards.Shard, index: int, byte: int, part: int, parts: int
) -> Iterator[tuple[dict[str, torch.Tensor], list[int]]]:
    """The rows of the shard's train records (of this slot's part) from record `index` (at
    `byte`), each with the position to resume at after it: the first record of the next row, or
    past the shard's last record after its last row."""
    data = plan.records
    assert data is not None
    if get_worker_info() is not None:  # one record at a time: a forked worker needs no threads
        comms.apply({"TOKENIZERS_PARALLELISM": "false"})
    render = chat.process_renderer(data, plan.eos_id)
    packer = RowPacker(plan.seq_len, data.packing, plan.eos_id)
    end = [index, byte, 0]
    for record in shards.records(shard, chat.fields(data), index, byte):
        end = [record.index + 1, record.after, 0]
        if record.index % parts != part:
            continue
        if plan.split_of(shard.source.path, record.key) != "train":
            continue
        done = packer.add(*_render(render, record, shard.source.path))
        if done is not None:
            yield batch_row(*done, data.packing), [record.index, record.byte, 0]
    last = packer.flush()
    if last is not None:
        yield batch_row(*last, data.packing), end


def held_out(data: DataConfig, plan: StreamPlan) -> dict[str, ChatArray]:
    """{val, test}: the rows of data.val_files (data.test_files), or of the records held out of
    data.files, each split packed as the cache packs it."""
    render = chat.process_renderer(data, plan.eos_id)
    packers = {split: RowPacker(plan.seq_len, data.packing, plan.eos_id) for split in SPLITS}
    found: dict[str, list[Row]] = {split: [] for split in packers}

    def add(split: str, record: shards.Record, path: str) -> None:
        done = packers[split].add(*_render(render, record, path))
        found[split] += [] if done is None else [done]

    named = [split for split in packers if getattr(data, f"{split}_files")]
    for split in named:
        files = sources.find(getattr(data, f"{split}_files"), f"data.{split}_files")
        for record, path in _read(shards.cut(files), data):
            add(split, record, path)
    if len(named) < 2:
        for record, path in _read(list(plan.shards), data):
            if (split := plan.split_of(path, record.key)) not in named and split != "train":
                add(split, record, path)
    for split, packer in packers.items():
        last = packer.flush()
        found[split] += [] if last is None else [last]
    return {split: ChatArray(done, plan.seq_len, data.packing) for split, done in found.items()}


def _read(found: list[shards.Shard], data: DataConfig) -> Iterator[tuple[shards.Record, str]]:
    """The records of the shards in order until HELD_OUT_BYTES of them, each with its file."""
    size = 0
    for shard in found:
        for record in shards.records(shard, chat.fields(data)):
            if size >= HELD_OUT_BYTES:
                return
            size += len(str(record.row))
            yield record, shard.source.path


def _render(render: chat.Render, record: shards.Record, path: str) -> chat.Sample:
    """The record's sample; a record that cannot be rendered is one line naming its file and
    line."""
    try:
        return render(record.row, record.where)
    except ConfigError as exc:
        if record.byte < 0:
            raise
        raise shards.at_line(exc, record.where, path, record.byte) from None
