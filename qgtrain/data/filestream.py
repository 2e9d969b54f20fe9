"""Data files streamed (data.stream: true): read, tokenized and packed in loader workers, no cache.

Why this shape: the unit of work is a shard (shards.py: a file, a byte range or row groups of
one), and a sample depends only on its shard: each shard's documents are tokenized into one
token stream cut into windows of data.seq_len (the tail shorter than a window is dropped). A
position is then per shard (the unit it is in and the token offset in it), exact, and the same
whoever reads it. Each
pass (epoch) orders the shards by a permutation of the run's seed and the pass, and deals them to
the reading slots (rank x loader worker) round-robin; a slot reads its shards one after another.

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
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import xxhash
from torch.utils.data import IterableDataset, get_worker_info

from ..config import DataConfig
from ..foundation.errors import ConfigError
from . import shards, sources, tokenizer
from .readers import SampleReader


@dataclass(frozen=True)
class StreamPlan:
    """Everything that decides the samples of a stream; its digest is saved with every position."""

    shards: tuple[shards.Shard, ...]
    text_field: str
    tokenizer: str
    eos_id: int
    seq_len: int
    seed: int
    split_seed: int
    held_out: tuple[float, float]  # val, test: fractions of data.files' documents
    digest: str

    def split_of(self, path: str, key: int) -> str:
        """prepare.py's draw for the cache, but keyed by a document's byte offset where the file
        is seekable (a shard that starts mid-file cannot count the documents before it)."""
        val, test = self.held_out
        if val + test == 0:
            return "train"
        draw = xxhash.xxh3_64_intdigest(f"{self.split_seed}\0{path}\0{key}".encode()) / 2.0**64
        return "val" if draw < val else "test" if draw < val + test else "train"


def plan(data: DataConfig, seed: int, key: str = "data.files") -> StreamPlan:
    """The plan of data.files (of a data.mix source: `key` names it in messages)."""
    files = sources.find(data.files, key)
    held_out = tuple(
        0.0 if getattr(data, f"{s}_files") else getattr(data, f"{s}_fraction")
        for s in ("val", "test")
    )
    info = tokenizer.describe(data.tokenizer)
    cut = tuple(shards.cut(files))
    identity = [
        [(s.source.path, s.source.size, s.source.mtime_ns, s.start, s.end) for s in cut],
        data.text_field,
        info.fingerprint,
        data.seq_len,
        seed,
        data.split_seed,
        held_out,
    ]
    digest = xxhash.xxh3_64_hexdigest(json.dumps(identity).encode())
    return StreamPlan(
        cut,
        data.text_field,
        data.tokenizer,
        info.eos_id,
        data.seq_len,
        seed,
        data.split_seed,
        (held_out[0], held_out[1]),
        digest,
    )


def deal(plan: StreamPlan, epoch: int, slot: int, slots: int) -> list[list[int]]:
    """The queue of `slot` in pass `epoch`: every slots-th shard of the pass's permutation."""
    order = list(range(len(plan.shards)))
    random.Random(plan.seed * 1_000_003 + epoch).shuffle(order)
    return [[shard, 0, -1, 0] for shard in order[slot::slots]]


def slot_reader(plan: StreamPlan, slot: int, slots: int, epoch: int = 0) -> SampleReader:
    """The reader of one slot of `slots`, for what composes readers (a mixture of sources)."""
    return FileReader(plan, slot, slots, epoch)


class FileReader:
    """One reading slot's samples (the SampleReader of readers.py). A queue entry is [shard, unit
    index, unit byte (-1: not seekable), tokens of that unit already taken]."""

    def __init__(self, plan: StreamPlan, slot: int, slots: int, epoch: int = 0) -> None:
        self.plan, self.slot, self.slots, self.epoch = plan, slot, slots, epoch
        self.queue = deal(plan, epoch, slot, slots)

    def __iter__(self) -> Iterator[torch.Tensor]:
        while self.queue:
            shard, index, byte, taken = self.queue[0]
            for sample, position in self._samples(self.plan.shards[shard], index, byte, taken):
                self.queue[0] = [shard, *position]  # before the yield: a state taken after it
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
        self.queue = [list(map(int, entry)) for entry in state["queue"]]

    def _samples(
        self, shard: shards.Shard, index: int, byte: int, taken: int
    ) -> Iterator[tuple[torch.Tensor, list[int]]]:
        """Windows of the shard's train documents, each with the position just past it."""
        seq_len, plan = self.plan.seq_len, self.plan
        buffer = np.zeros(0, dtype=np.uint32)
        for unit in shards.units(shard, plan.text_field, index, byte):
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
    if any(not 0 <= entry[0] < len(plan.shards) for entry in state["queue"]):
        raise ValueError("the position names a shard the data files do not have")


class FileStream(IterableDataset[torch.Tensor]):
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

    def __iter__(self) -> Iterator[torch.Tensor]:
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
        self._reader, self._merged = None, [list(map(int, entry)) for entry in merged]


def check(plan: StreamPlan) -> None:
    """What would otherwise surface at the first step, deep in a loader worker: fewer shards than
    ranks (a rank with none ends every epoch at once), or files with no training sample at all."""
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if len(plan.shards) < world_size:
        raise ConfigError(
            f"data.files: {len(plan.shards)} shard(s) for {world_size} ranks, and each rank reads "
            f"whole shards (a file, or {shards.SHARD_BYTES >> 20} MB of a plain-text or JSON Lines "
            "file); give at least as many files as ranks, or set data.stream: false"
        )
    if next(iter(FileReader(plan, 0, 1)), None) is None:
        raise ConfigError(
            f"data.files: the stream yields nothing: no file holds data.seq_len={plan.seq_len} "
            "tokens of training documents (every document empty, or held out); check "
            "data.files and data.text_field"
        )
