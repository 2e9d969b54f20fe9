"""Data files streamed (data.stream: true): read, tokenized and packed in loader workers, no cache.

Why this shape: the unit of work is a shard (shards.py: a file, a byte range or row groups of
one), and a sample depends only on its shard: each shard's documents are tokenized into one
token stream cut into windows of data.seq_len (the tail shorter than a window is dropped). A
position is then per shard (the unit it is in and the token offset in it), exact, and the same
whoever reads it. Each
pass (epoch) orders the shards by a permutation of the run's seed and the pass, and deals them to
the reading slots (rank x loader worker) round-robin; a slot reads its shards one after another.
A source with fewer shards than slots (a small file beside a corpus, at any world size) is not
cut again (the cut would then depend on the world size, and a position saved by one would name
nothing in another): slot k takes the pass's shard k mod S, shared by the slots of that residue,
each taking every n-th unit of it (a line, a row: a plain-text file is then read a line a unit),
so each unit is read once a pass and a position stays per slot. A queue entry carries its part.

A slot's state is its queue: the shards it has left, the first with its position. That is all a
resume needs: on the same world size torchdata's loader hands each worker its own queue back; on
another, every rank's queues (each rank-N.pt of the checkpoint) are merged and dealt again to the
new slots (load_merged), so a shard started is continued where it was and none finished is read
again: no sample repeated or skipped. The state carries a digest of the files and settings, so a
changed file fails the resume instead of continuing somewhere else.

Held-out documents (data.val_fraction, data.test_fraction) are drawn by a hash of the split seed,
the file and the document's place in it (its byte offset where the file is seekable, else its
index), and left out of the train stream; heldout.py reads them for evaluation. An empty document
adds nothing to the stream (the cache gives it an end-of-text token), so files of empty documents
are refused at the start (check) rather than trained on as end-of-text tokens.
"""

from __future__ import annotations

import copy
import logging
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

from ...foundation.errors import ConfigError
from .. import tokenizer
from ..files import shards
from .chat_stream import rows as chat_rows
from .plan import StreamPlan as StreamPlan
from .plan import plan as plan
from .readers import SampleReader

log = logging.getLogger("qgtrain")
Sample = torch.Tensor | dict[str, torch.Tensor]  # a window of tokens; a row of chat records


def deal(plan: StreamPlan, epoch: int, slot: int, slots: int) -> list[list[int]]:
    """The queue of `slot` in pass `epoch`: every slots-th shard of the pass's permutation; with
    fewer shards than slots, part slot // S of shard slot mod S (of the slots sharing it)."""
    order = list(range(len(plan.shards)))
    random.Random(plan.seed * 1_000_003 + epoch).shuffle(order)
    count = len(order)
    if count >= slots or not count:
        return [[shard, 0, -1, 0, 0, 1] for shard in order[slot::slots]]
    return [[order[slot % count], 0, -1, 0, slot // count, shared(count, slots, slot % count)]]


def shared(count: int, slots: int, shard: int) -> int:
    """How many of `slots` share the pass's `shard`-th of `count` shards (slots of its residue)."""
    return len(range(shard, slots, count))


def entry(saved: list[Any]) -> list[int]:
    """A saved queue entry; one saved before shards were shared is its shard's only part."""
    values = list(map(int, saved))
    return values + [0, 1] if len(values) == 4 else values


def slot_reader(plan: StreamPlan, slot: int, slots: int, epoch: int = 0) -> SampleReader:
    """The reader of one slot of `slots`, for what composes readers (a mixture of sources)."""
    return FileReader(plan, slot, slots, epoch)


class FileReader:
    """One reading slot's samples (the SampleReader of readers.py). A queue entry is [shard, unit
    index, unit byte (-1: not seekable), tokens of that unit already taken, part, parts]: the
    slot reads the shard's units whose index is part modulo parts."""

    def __init__(self, plan: StreamPlan, slot: int, slots: int, epoch: int = 0) -> None:
        self.plan, self.slot, self.slots, self.epoch = plan, slot, slots, epoch
        self.queue = deal(plan, epoch, slot, slots)

    def __iter__(self) -> Iterator[Sample]:
        while self.queue:
            shard, index, byte, taken, part, parts = entry(self.queue[0])
            where = (self.plan.shards[shard], index, byte, taken, part, parts)
            for sample, position in self._samples(*where):
                # before the yield: a state taken after it
                self.queue[0] = [shard, *position, part, parts]
                yield sample
            self.queue.pop(0)

    def next_pass(self) -> None:
        self.epoch += 1
        self.queue = deal(self.plan, self.epoch, self.slot, self.slots)

    def state_dict(self) -> dict[str, Any]:
        return {
            "digest": self.plan.digest,
            "epoch": self.epoch,
            "slot": self.slot,
            "slots": self.slots,
            "queue": [list(entry) for entry in self.queue],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(self.plan, state)
        self.epoch, self.slot, self.slots = state["epoch"], state["slot"], state["slots"]
        self.queue = [entry(saved) for saved in state["queue"]]

    def _samples(
        self, shard: shards.Shard, index: int, byte: int, taken: int, part: int, parts: int
    ) -> Iterator[tuple[Sample, list[int]]]:
        """Windows of the shard's train documents (of this slot's part), each with the position
        just past it; chat records' rows where the plan renders records (chat_stream.py)."""
        seq_len, plan = self.plan.seq_len, self.plan
        if plan.records is not None:
            yield from chat_rows(plan, shard, index, byte, part, parts)
            return
        buffer = np.zeros(0, dtype=np.uint32)
        lines = 1 if parts > 1 else None  # a shared plain-text file: a line a unit
        for unit in shards.units(shard, plan.text_field, index, byte, lines):
            if unit.index % parts != part:
                continue
            if not unit.text and not (unit.ends and shard.source.kind == "text"):
                continue  # an empty document adds nothing, not even an end-of-text token
            if plan.split_of(shard.source.path, unit.key) != "train":
                continue
            ids = tokenizer.encode_pieces(plan.tokenizer, plan.eos_id, [unit.text], [unit.ends])
            buffer = np.concatenate([buffer, ids[taken if unit.index == index else 0 :]])
            count = len(buffer) // seq_len
            if not count:
                continue
            # every window the unit completes, converted at once; the last ones end in this unit
            windows = torch.from_numpy(buffer[: count * seq_len].astype(np.int64))
            buffer, left = buffer[count * seq_len :], len(buffer) - seq_len
            for row in windows.view(count, seq_len):
                yield row, [unit.index, unit.byte, len(ids) - left]
                left -= seq_len


def check_state(plan: StreamPlan, state: Any) -> None:
    """A saved position that fits these files and settings, or a ValueError saying why not."""
    fields = ("digest", "epoch", "slot", "slots", "queue")
    if not isinstance(state, dict) or any(name not in state for name in fields):
        raise ValueError(f"not a position in data files (expected the fields {', '.join(fields)})")
    if state["digest"] != plan.digest:
        raise ValueError(
            "the data files or the settings that cut them into samples (data.files, "
            "their sizes and times, data.seq_len, data.tokenizer, data.text_field, "
            "the held-out split, train.seed) changed since the checkpoint"
        )
    if any(not 0 <= saved[0] < len(plan.shards) for saved in state["queue"]):
        raise ValueError("the position names a shard the data files do not have")
    if any(not 0 <= part < parts for *_, part, parts in map(entry, state["queue"])):
        raise ValueError("the position names a part of a shared shard that is not there")


class FileStream(IterableDataset[Sample]):
    """The train split of data files as a stream: this rank's slots, one per loader worker."""

    stream_label = "data.files (data.stream: true)"

    def __init__(self, plan: StreamPlan) -> None:
        self.plan, self.epoch = plan, 0
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self._reader: FileReader | None = None
        self._merged: list[list[int]] | None = None  # re-dealt after a change of world size

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self._reader, self._merged = epoch, None, None

    def __iter__(self) -> Iterator[Sample]:
        return iter(self.reader())

    def reader(self) -> FileReader:
        if self._reader is None:
            info = get_worker_info()
            workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
            slot, slots = self.rank * workers + worker, self.world * workers
            self._reader = FileReader(self.plan, slot, slots, self.epoch)
            if self._merged is not None:
                self._reader.queue = copy.deepcopy(self._merged[slot::slots])
        return self._reader

    def state_dict(self) -> dict[str, Any]:
        return self.reader().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        reader = FileReader(self.plan, 0, 1, self.epoch)
        reader.load_state_dict(state)
        self._reader = reader

    def load_merged(self, states: list[Any]) -> None:
        """Every slot's saved state of another world size: their queues, dealt again to this run's
        slots when the workers start (the first step). A slot missing from them had read nothing:
        its queue is dealt as it was."""
        for state in states:
            check_state(self.plan, state)
        epochs = {state["epoch"] for state in states}
        counts = {state["slots"] for state in states}
        if len(epochs) != 1 or len(counts) != 1:
            raise ValueError(
                f"the ranks' positions disagree (epochs {sorted(epochs)}, slots {sorted(counts)})"
            )
        (epoch,), (slots,) = epochs, counts
        if epoch != self.epoch:
            raise ValueError(f"the ranks' positions are in epoch {epoch}, the run in {self.epoch}")
        by_slot = {state["slot"]: state["queue"] for state in states}
        merged = []
        for slot in range(slots):
            merged += by_slot.get(slot, deal(self.plan, epoch, slot, slots))
        self._reader, self._merged = None, [entry(saved) for saved in merged]


def check(plan: StreamPlan, world: int | None = None, slots: int | None = None) -> None:
    """What would otherwise surface at the first step, deep in a loader worker: files with no
    training sample at all, or (fewer shards than the `slots` of `world` ranks) a shared shard
    whose part for some slot holds none. How a shared source is read is logged in one line."""
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
    slots = slots or world * max(plan.workers, 1)
    if next(iter(FileReader(plan, 0, 1)), None) is None:
        raise ConfigError(
            f"{plan.key}: the stream yields nothing: no file holds data.seq_len={plan.seq_len} "
            f"tokens of training documents (every document empty, or held out); check "
            f"{plan.key} and data.text_field"
        )
    count = len(plan.shards)
    if count >= slots:
        return
    splits = sorted({shared(count, slots, first) for first in range(count)})
    log.info(
        "%s: %d shard(s) for %d reading slots (%d rank(s) x %d loader worker(s)): each shard "
        "is read by %s slots together, slot k of n taking its units (lines, rows) k, k+n, ...",
        plan.key,
        count,
        slots,
        world,
        slots // world,
        " or ".join(map(str, splits)),
    )
    for shard, parts, part in (
        (shard, parts, part) for shard in range(count) for parts in splits for part in range(parts)
    ):
        reader = FileReader(plan, 0, 1)
        reader.queue = [[shard, 0, -1, 0, part, parts]]
        if next(iter(reader), None) is None:
            raise ConfigError(
                f"{plan.key}: {plan.shards[shard].source.path} is read by {parts} of the "
                f"{slots} reading slots together ({world} rank(s) x {slots // world} loader "
                f"worker(s)), each taking every {parts}th unit (line, row), and part {part} "
                f"holds no window of data.seq_len={plan.seq_len} tokens; give it more text, use "
                "fewer data.num_workers, or set data.stream: false"
            )
