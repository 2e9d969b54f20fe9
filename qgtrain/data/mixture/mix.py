"""Weighted sources (data.mix) as one stream: each training sample is drawn from one source, chosen
per reading slot (one loader worker of one rank), so that every source's share converges to its
weight / the sum of the weights.

The mixture is an IterableDataset read like any stream (streams.py): through torchdata's
StatefulDataLoader, its state saved per rank and per worker. A slot's state is how many samples it
has drawn, each source's count and passes, and each source reader's own state: a source is any
SampleReader (readers.py), a cached one (cached.py) or a streamed one, so either kind mixes.

The choice is a Weyl sequence, not independent draws: draw i of a slot takes the point
phase + i * 2^64/phi (mod 2^64, exact in integers) and the source whose interval of [0, 2^64)
holds it, the intervals sized by weight. Its points spread evenly from the start, so after n
draws each source is within a few samples of its share, where independent draws would be about
sqrt(n) off; the phase is seeded per slot, and the state of the choice is the one count i, so a
resume is O(1). The order is not random: a source's samples recur at near-regular intervals.
A source that runs out starts its next pass (logged), so the mixture never ends: train.max_steps
ends the run. The counts reach the metrics (samples_<name>) through the loader's state, which holds
each worker's as of the last batch the rank took: exact, and resumed with the rest. On another
world size the slots' positions are merged and dealt again (merge.py): each streamed source
pass by pass, each slot's count of draws carried, so no sample is repeated or skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash
from torch.utils.data import IterableDataset, get_worker_info

from ...foundation.errors import ConfigError
from ..stream.readers import SampleReader
from ..stream.streams import dataset_states
from .merge import Merged, merge, part

log = logging.getLogger("qgtrain")

GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / phi, odd: draw i's point steps through all of [0, 2^64)
SPAN = 1 << 64


@dataclass(frozen=True)
class Source:
    """A source of the mixture: `reader(slot, slots)` is slot `slot`'s reader of it."""

    name: str
    weight: float
    reader: Callable[[int, int], SampleReader]


@dataclass
class _Slot:
    """What a slot has read: the mixture's state there."""

    readers: list[SampleReader]
    draws: int
    counts: list[int]
    passes: list[int]
    later: list[list[Any]]  # per source: its queues of the passes after this one a merge carried


class Mixture(IterableDataset[Any]):
    """This rank's part of the mixture (rank and world size taken where the task is built). The
    positions saved by another world size are merged and dealt again (load_merged, merge.py)
    where the sources are streamed; a mixture with a cached source refuses it in one line."""

    stream_label = "data.mix"

    def __init__(self, sources: Sequence[Source], seed: int, rank: int, world_size: int) -> None:
        self.sources, self.seed = list(sources), seed
        self.rank, self.world_size = rank, world_size
        self.names = [source.name for source in sources]
        self.bounds = bounds([source.weight for source in sources])
        self._loaded: dict[str, Any] | None = None  # a saved state, taken by the next __iter__
        self._slot: _Slot | None = None
        self._merged: Merged | None = None  # another world size's positions, taken likewise

    def slot(self) -> tuple[int, int]:
        """(this reading slot, every rank's slots together)."""
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * workers + worker, self.world_size * workers

    def __iter__(self) -> Iterator[Any]:
        slot, slots = self.slot()
        state = self._start(slot, slots)
        self._slot, self._loaded, self._merged = state, None, None
        phase = xxhash.xxh3_64_intdigest(f"{self.seed}/{slot}".encode())
        samples = [iter(reader) for reader in state.readers]
        while True:
            chosen = choose(phase, state.draws, self.bounds)
            sample = next(samples[chosen], _END)
            while sample is _END:
                carried = bool(state.later[chosen])
                samples[chosen] = self._next_pass(state, chosen, slot, slots)
                sample = next(samples[chosen], _END)
                if sample is _END and not carried:
                    raise ConfigError(
                        f"data.mix: source {self.names[chosen]!r} yields no sample in a whole "
                        f"pass of reading slot {slot} of {slots} (its part for that slot holds "
                        f"no window of training text); give the source more text, use fewer "
                        "data.num_workers, or set data.stream: false"
                    )
            state.draws += 1
            state.counts[chosen] += 1
            yield sample

    def _start(self, slot: int, slots: int) -> _Slot:
        """Where this slot starts: a saved position of this world size, its part of the merged
        positions of another (merge.py), or the start."""
        readers = [source.reader(slot, slots) for source in self.sources]
        zeros = [0] * len(readers)
        state = _Slot(readers, 0, list(zeros), list(zeros), [[] for _ in readers])
        if self._merged is not None:
            merged = self._merged
            state.draws = merged.draws[slot] if slot < len(merged.draws) else 0
            state.counts = list(merged.counts) if slot == 0 else state.counts
            for index, reader in enumerate(readers):
                epoch, queue, later = part(merged, index, slot, slots)
                reader.load_state_dict({**reader.state_dict(), "epoch": epoch, "queue": queue})
                state.passes[index], state.later[index] = epoch, later
        elif self._loaded is not None:
            saved = self._loaded
            state.draws, state.counts, state.passes = (
                int(saved["draws"]),
                list(saved["counts"]),
                list(saved["passes"]),
            )
            state.later = [list(later) for later in saved.get("later") or state.later]
            for reader, kept in zip(readers, saved["readers"] or [None] * len(readers)):
                if kept is not None:
                    reader.load_state_dict(kept)
        return state

    def _next_pass(self, state: _Slot, chosen: int, slot: int, slots: int) -> Iterator[Any]:
        """The source's next pass: the part a merge carried for it, or the reader's own deal."""
        reader = state.readers[chosen]
        if state.later[chosen]:
            queue = state.later[chosen].pop(0)
            epoch = int(reader.state_dict()["epoch"]) + 1
            reader.load_state_dict({**reader.state_dict(), "epoch": epoch, "queue": queue})
        else:
            reader.next_pass()
        state.passes[chosen] += 1
        log.info(
            "data.mix: source %r ran out in reading slot %d of %d after %d of its samples: "
            "starting its pass %d",
            self.names[chosen],
            slot,
            slots,
            state.counts[chosen],
            state.passes[chosen] + 1,
        )
        return iter(reader)

    def state_dict(self) -> dict[str, Any]:
        """This slot's position; before it has read, the one it will start from."""
        if self._slot is None and self._merged is not None:  # a worker's state at its start
            return self._state(self._start(*self.slot()))
        if self._slot is None:
            if self._loaded is not None:
                return self._loaded
            zeros = [0] * len(self.sources)
            return {
                "names": self.names,
                "draws": 0,
                "counts": zeros,
                "passes": zeros,
                "readers": None,
            }
        return self._state(self._slot)

    def _state(self, state: _Slot) -> dict[str, Any]:
        saved = {
            "names": self.names,
            "draws": state.draws,
            "counts": list(state.counts),
            "passes": list(state.passes),
            "readers": [reader.state_dict() for reader in state.readers],
        }
        if any(state.later):  # only after a merge: a state of its own world size is as it was
            saved["later"] = [[list(map(list, queue)) for queue in later] for later in state.later]
        return saved

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if list(state["names"]) != self.names:
            raise ValueError(
                f"the checkpoint mixes the sources {', '.join(state['names'])}; data.mix now "
                f"names {', '.join(self.names)}"
            )
        self._loaded, self._slot, self._merged = state, None, None

    def load_merged(self, states: list[Any]) -> None:
        """Every slot's saved state of another world size, merged (merge.py) and dealt again
        to this run's slots when the workers start; a ValueError says why they cannot be."""
        for state in states:
            self.load_state_dict(state)  # the names checked
        self._loaded, self._slot, self._merged = None, None, merge(self.sources, states)


_END = object()


def bounds(weights: Sequence[float]) -> list[int]:
    """Each source's upper end in [0, 2^64), its interval's size proportional to its weight."""
    total, running, ends = float(sum(weights)), 0.0, []
    for weight in weights:
        running += weight
        ends.append(min(int(running / total * SPAN), SPAN))
    ends[-1] = SPAN
    return ends


def choose(phase: int, draw: int, ends: Sequence[int]) -> int:
    point = (phase + draw * GOLDEN) % SPAN
    return next(index for index, end in enumerate(ends) if point < end)


def source_counts(loader: Any, reads: bool) -> Callable[[], dict[str, int]] | None:
    """The samples each source has given this rank's training so far (as of the last batch taken),
    where the loader reads a mixture; None otherwise. A rank that `reads` nothing (data.dispatch
    sends it rank 0's batches) counts none: asking its loader for its state would start it."""
    mixture = getattr(loader, "dataset", None)
    if not isinstance(mixture, Mixture):
        return None

    def counts() -> dict[str, int]:
        totals = [0] * len(mixture.names)
        for state in dataset_states(loader.state_dict()) if reads else []:
            for index, count in enumerate(state["counts"]):
                totals[index] += int(count)
        return dict(zip(mixture.names, totals))

    return counts
