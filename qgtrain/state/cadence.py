"""When a checkpoint is due by the clock, and when the node-local tier saves.

A save by the clock (checkpoint.every_minutes, and the local tier's `auto`) is rank 0's decision,
which every rank agrees on at the next agreement; the agreement reaches the save agreements after
rank 0 asked, so a clock that said "due" again meanwhile would save again. ByClock asks once per
save.

The local tier saves every checkpoint.local_every_steps steps, or, with `auto`, by the clock at
the interval that loses least to saves and failures together. A save stalls the loop for C
seconds; a failure loses the work since the last save, half an interval on average. With the job's
mean time between failures M (checkpoint.gpu_mtbf_hours over its ranks), the interval that wastes
least is, to first order, sqrt(2 C M) (Young 1974, Daly 2006; bench/goodput.py models a job with
it). C is measured: the stall of the tier's last save, the first made at the first agreement.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from ..config.checkpoint import CheckpointConfig

log = logging.getLogger("qgtrain")


def best_interval_s(stall_s: float, mtbf_s: float) -> float:
    """Young/Daly: the seconds between saves that waste least."""
    return math.sqrt(2 * stall_s * mtbf_s)


@dataclass
class ByClock:
    saved_at: float | None = None  # time.monotonic() of the last save; None: none yet
    asked: bool = False  # a save asked for and not yet made

    def due(self, now: float, interval_s: float) -> bool:
        """Whether to ask for a save now: once `interval_s` has passed since the last (at once
        where there was none), and not again before it is made."""
        if self.asked:
            return False
        self.asked = self.saved_at is None or now - self.saved_at >= interval_s
        return self.asked

    def saved(self, now: float) -> None:
        self.saved_at, self.asked = now, False


@dataclass
class LocalCadence:
    every_steps: int  # 0: by the clock (auto)
    mtbf_s: float  # the job's
    clock: ByClock = field(default_factory=ByClock)
    stall_s: float = 0.0  # the last save's stall

    @classmethod
    def of(cls, cfg: CheckpointConfig, ranks: int) -> LocalCadence:
        every = 0 if cfg.local_every_steps == "auto" else int(cfg.local_every_steps)
        return cls(every, cfg.gpu_mtbf_hours * 3600 / ranks)

    def due(self, step: int) -> bool:
        """By the step: the same answer on every rank."""
        return bool(self.every_steps) and step % self.every_steps == 0

    def due_by_clock(self, now: float) -> bool:
        """By this rank's clock (rank 0's is agreed on): the first save at once, to measure it."""
        interval = best_interval_s(self.stall_s, self.mtbf_s)
        return not self.every_steps and self.clock.due(now, interval)

    def saved(self, stall_s: float, now: float, tell: bool) -> None:
        """A save made, stalling the loop `stall_s`; `tell`: say the interval it leads to (rank 0,
        the first time)."""
        first = self.clock.saved_at is None
        self.clock.saved(now)
        self.stall_s = stall_s
        if tell and first and not self.every_steps:
            log.info(
                "node-local tier by the clock (checkpoint.local_every_steps: auto): every %.1f s, "
                "sqrt(2 x a save's stall of %.3f s x the job's MTBF of %.2f h)",
                best_interval_s(stall_s, self.mtbf_s),
                stall_s,
                self.mtbf_s / 3600,
            )
