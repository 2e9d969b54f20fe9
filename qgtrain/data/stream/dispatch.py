"""A stream that cannot be split over ranks, read by rank 0 alone (data.dispatch: true): each step
rank 0 draws every rank's micro-batches from the one stream and sends each rank its own, as
forgather's dispatched loader does (seed 004).

Rank 0's reading is a StreamBatches of one rank whose batches are counted one by one, so its data
position is the run's own (samples of all ranks in the epoch) and its saved state (the loader's,
with its workers', or the samples consumed) is the whole stream's: rank 0's checkpoint file holds
it, the others hold only the mark that they were dispatched to. No rank count is in that state,
so a resume on another world size takes it as it is: rank 0 just draws and scatters a step's
micro-batches for the ranks there are now. The batches, the position after
them, or an error rank 0 met, go to every rank in one scatter on the streams' gloo group, as data
(runtime/objects.py: torch.save read back with weights_only, so a batch is tensors in dicts, lists
and tuples, never a pickle), so the ranks never disagree on where the run is, and an epoch that
ends on rank 0 ends for all. The price is rank 0 reading for everyone and one message a
step; bench/stream_dispatch.py measures it against every rank reading its own part.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.distributed as dist

from ...foundation.errors import ConfigError
from ...runtime import distributed, objects, wire
from .streams import Position, StreamBatches


class DispatchedBatches:
    """Training micro-batches of a stream read on rank 0 and sent to each rank."""

    def __init__(
        self, loader: Any, samples_per_micro_batch: int, seed: int, label: str, group: Any
    ) -> None:
        self.samples, self.label, self.group = samples_per_micro_batch, label, group
        self.rank = dist.get_rank() if group is not None else 0
        self.world = dist.get_world_size() if group is not None else 1
        self.loader = loader
        # rank 0's reader: one batch of train.batch_size is one batch's worth of samples
        self.reader = (
            StreamBatches(loader, loader.batch_size, seed, label, None) if self.rank == 0 else None
        )
        self._epoch_samples: dict[int, int] = {}

    def step(self, position: Position, micro_batches: int) -> list[Any]:
        before = position.epoch, position.samples_in_epoch
        parts: list[Any] | None = None
        if (reader := self.reader) is not None:
            drawn, failure = distributed.attempt(
                lambda: reader.step(position, micro_batches * self.world)
            )
            where = (position.epoch, position.samples_in_epoch)
            parts = [
                (None, None, failure)
                if failure
                else (drawn[r * micro_batches : (r + 1) * micro_batches], where, None)
                for r in range(self.world)
            ]
        if self.group is not None:
            mine = objects.scatter(parts, self.group, "batches")
        else:
            mine = parts[0] if parts else None
        batches, (epoch, samples), failure = mine
        if failure is not None:
            wire.decode(failure, "rank 0's stream")
        if epoch != before[0]:  # the epoch before ended at its last position
            self._epoch_samples[before[0]] = before[1]
        position.epoch, position.samples_in_epoch = epoch, samples
        return list(batches)

    def saved(self) -> dict[str, Any]:
        own = self.reader.saved() if self.reader is not None else {}
        return {"dispatched": True, **own}

    def restore(self, saved: dict[str, Any] | None, checkpoint: Path) -> None:
        """Saved by another world size ({"ranks": [...]}), rank 0's file still holds the whole
        stream's state, which no rank count enters: the run's position counts the samples of all
        ranks, so only how many micro-batches rank 0 draws and scatters a step changes."""
        if saved is not None and "ranks" in saved:
            saved = (saved["ranks"] or [None])[0]
        if saved is None or not saved.get("dispatched"):
            raise ConfigError(
                f"data.dispatch: {checkpoint} was saved by a run whose ranks each read their own "
                "part of the stream; resume it with data.dispatch: false, or set "
                "checkpoint.resume: never"
            )
        if self.reader is not None:
            self.reader.restore({k: v for k, v in saved.items() if k != "dispatched"}, checkpoint)

    def between(self, start: tuple[int, int], end: tuple[int, int]) -> int:
        """Micro-batches each rank took from data position `start` to `end`."""
        whole = sum(self._epoch_samples.get(epoch, 0) for epoch in range(start[0], end[0]))
        return (whole + end[1] - start[1]) // self.samples
