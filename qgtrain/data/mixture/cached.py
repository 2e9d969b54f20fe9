"""One mixture source's cached token windows, read by one slot (one loader worker of one rank) in
a seeded shuffled order per pass: the SampleReader a mixture draws from when the source was
tokenized into the cache (data.mix without data.stream).

Each pass is a permutation of the source's windows, made from the seed, the source and the pass
alone, and slot s of S takes every S-th window of it, so the slots of a pass share its windows
without overlap and without talking to each other. The position is (pass, offset into this slot's
share): two integers, so a resume is O(1), however far the run has read. The permutation is
torch.randperm of the source's window count (8 bytes a window, made once a pass); a source of
hundreds of millions of windows belongs in data.stream instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..tokens import TokenWindows


class CachedReader:
    """Slot `slot` of `slots` reading `windows` (any map-style dataset) pass after pass."""

    def __init__(self, windows: TokenWindows, seed: int, slot: int, slots: int) -> None:
        self.windows, self.seed, self.slot, self.slots = windows, seed, slot, slots
        self.pass_, self.offset = 0, 0
        self._order: tuple[int, torch.Tensor] | None = None  # (pass, this slot's share of it)

    def share(self) -> torch.Tensor:
        """This slot's windows of the current pass, in reading order."""
        if self._order is None or self._order[0] != self.pass_:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + self.pass_)
            order = torch.randperm(len(self.windows), generator=generator)
            self._order = (self.pass_, order[self.slot :: self.slots])
        return self._order[1]

    def __iter__(self) -> Iterator[Any]:
        share = self.share()
        while self.offset < len(share):
            index = int(share[self.offset])
            self.offset += 1  # before the yield: a state taken after it is past this sample
            yield self.windows[index]

    def next_pass(self) -> None:
        self.pass_, self.offset = self.pass_ + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"pass": self.pass_, "offset": self.offset, "windows": len(self.windows)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["windows"] != len(self.windows):
            raise ValueError(
                f"the checkpoint's source had {state['windows']} training windows, this one has "
                f"{len(self.windows)}: its files or data.seq_len changed"
            )
        self.pass_, self.offset = int(state["pass"]), int(state["offset"])
