"""A streamed mixture's positions saved by another world size, merged and dealt again to this run's
reading slots (Mixture.load_merged), as filestream.py does for one stream: no sample repeated or
skipped, the shares kept.

Why per pass: the slots of a mixture draw each source at their own pace, so when the checkpoint
was saved one slot may be in a source's pass 3 while another is still in its pass 2. The work a
source has left is then, pass by pass from the earliest any slot is in, what every saved slot
still had of it: the rest of its queue in the pass it is in, nothing of a pass it finished, all of
its share of a pass it had not started (its own deal, or a share carried from an earlier merge).
Each pass's leftovers, in slot order, are dealt round-robin to the new slots; a new slot starts at
the earliest pass with its part of each later one carried ("later"), and deals its own passes
only past those. Every shard's rest of every pass goes to exactly one new slot.

The choice of source stays a Weyl sequence per slot: new slot t continues the sequence of saved
slot t (its phase is seeded by the slot, its count of draws carried), a slot the old run did not
have starts its own; any run of draws of a Weyl sequence meets the weights within a sample or two,
so the shares stay exact over the merge. The samples each source gave (samples_<name>) go to new
slot 0, the first to yield after a start, so the run's totals carry over whole.

The positions are those of streamed sources (filestream.FileReader's state: epoch, queue, slot,
slots); a cached source's position is an offset into its slot's share, which is not dealt again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from ..stream.readers import SampleReader


class Reading(Protocol):
    """What of a mixture's source the merge needs (mix.Source): its reader of a slot."""

    @property
    def reader(self) -> Callable[[int, int], SampleReader]: ...


@dataclass(frozen=True)
class Merged:
    """Every saved slot's position, by source: each pass left from `first[k]` on, as queue entries
    of the saved slots together; each saved slot's draws; each source's samples over all slots."""

    first: list[int]
    passes: list[list[list[list[int]]]]
    draws: list[int]
    counts: list[int]


def merge(sources: Sequence[Reading], states: list[dict[str, Any]]) -> Merged:
    """The merge of `states` (each saved slot's Mixture state: those that had read nothing are
    left out, as filestream.load_merged deals a missing slot afresh)."""
    started = [state for state in states if state.get("readers") is not None]
    slots = _slots(started, len(sources))
    by_slot: dict[int, dict[str, Any]] = {}
    for state in started:
        slot = int(state["readers"][0]["slot"])
        if slot in by_slot or not 0 <= slot < slots:
            raise ValueError(f"the ranks' positions name reading slot {slot} twice or out of range")
        by_slot[slot] = state
    first, passes = [], []
    for index, source in enumerate(sources):
        where = [_position(source, index, by_slot.get(slot), slot, slots) for slot in range(slots)]
        start = min(epoch for epoch, _, _ in where)
        end = max(epoch + len(later) for epoch, _, later in where)
        first.append(start)
        passes.append(
            [
                [
                    entry
                    for slot, (epoch, queue, later) in enumerate(where)
                    for entry in _left(source, slot, slots, epoch, queue, later, nth)
                ]
                for nth in range(start, end + 1)
            ]
        )
    draws = [int(by_slot[slot]["draws"]) if slot in by_slot else 0 for slot in range(slots)]
    counts = [sum(int(state["counts"][k]) for state in started) for k in range(len(sources))]
    return Merged(first, passes, draws, counts)


def part(merged: Merged, index: int, slot: int, slots: int) -> tuple[int, list[Any], list[Any]]:
    """New slot `slot` of `slots`'s share of source `index`: (its pass, its queue in that pass,
    its queues of the passes after it that the merge carries)."""
    shares = [[list(entry) for entry in left[slot::slots]] for left in merged.passes[index]]
    return merged.first[index], shares[0], shares[1:]


def _slots(states: list[dict[str, Any]], sources: int) -> int:
    """The saved run's reading slots, which every position must agree on."""
    for state in states:
        readers = state["readers"]
        if len(readers) != sources or any(
            not isinstance(r, dict) or "queue" not in r or "epoch" not in r for r in readers
        ):
            raise ValueError(
                "a cached source's position (data.stream: false) is an offset into its "
                "slot's share and is not dealt again to another world size"
            )
    counts = {int(r["slots"]) for state in states for r in state["readers"]}
    if len(counts) > 1:
        raise ValueError(f"the ranks' positions disagree on the reading slots ({sorted(counts)})")
    return counts.pop() if counts else 1


def _position(
    source: Reading, index: int, state: dict[str, Any] | None, slot: int, slots: int
) -> tuple[int, list[Any], list[Any]]:
    """(pass, queue, carried passes) of saved slot `slot` in source `index`, its state checked
    against the source's files and settings by the reader itself; a slot that read nothing is at
    the start of its pass 0."""
    reader = source.reader(slot, slots)
    if state is None:
        return 0, reader.state_dict()["queue"], []
    saved = state["readers"][index]
    reader.load_state_dict(saved)
    later = (state.get("later") or [[]] * len(state["readers"]))[index]
    return int(saved["epoch"]), reader.state_dict()["queue"], list(later)


def _left(
    source: Reading,
    slot: int,
    slots: int,
    epoch: int,
    queue: list[Any],
    later: list[Any],
    nth: int,
) -> list[Any]:
    """What saved slot `slot` had left of pass `nth`."""
    if nth < epoch:
        return []
    if nth == epoch:
        return queue
    if nth - epoch <= len(later):
        return list(later[nth - epoch - 1])
    reader = source.reader(slot, slots)
    for _ in range(nth):
        reader.next_pass()
    return list(reader.state_dict()["queue"])
