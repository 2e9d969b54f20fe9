"""Where a run's time goes, across every start, retry and requeue: its goodput, the share that
trained steps for the first time.

On a thousand GPUs something fails every few hours; what a failure costs is the time around it
(the start, the steps lost since the last checkpoint, the wait for a retry or the queue), and that
is what a user weighs against the checkpoint cadence or a spare node. Rank 0 keeps the run's
ledger in status.json under `time`, written at every report and at the end of each start:

    training     steps the run reaches for the first time
    recomputed   steps at or below the highest an earlier start recorded: lost to a failure and
                 trained again (those after its last record are lost into `waiting`)
    checkpoint   what the loop waits for a checkpoint (the write itself when it is blocking)
    evaluation   validations, test evaluations and downstream tasks
    startup      a start's process start to its first step (imports, rendezvous, restore)
    other        the rest of a start: reports, the agreement's waits, the end
    waiting      before a start: the allocation's first seconds (the batch script, srun), and
                 after a failure the killed start's last seconds, the retry's back-off or the queue

Together they are the run's time, from its first allocation's start (SLURM_JOB_START_TIME where
Slurm sets it, else the start the batch script exports; without either, as under torchrun, the
first process's) to the last write: each start adds what it measured, `other` holding what no kind
claimed, and `waiting` the gap since the last write.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..foundation.pinned import Pinned
from ..runs import rundir
from ..runtime.startup import process_age_s

log = logging.getLogger("qgtrain")
KINDS = ("training", "recomputed", "checkpoint", "evaluation", "startup", "other", "waiting")


@dataclass
class Ledger:
    """What status.json's `time` holds: seconds by kind, the highest step trained, the starts
    counted and when it was last written (Unix time)."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(KINDS, 0.0))
    reached: int = 0
    starts: int = 0
    written: float | None = None

    @classmethod
    def read(cls, run_dir: Path) -> Ledger:
        return cls.of(rundir.read_status(run_dir))

    @classmethod
    def of(cls, status: dict[str, object]) -> Ledger:
        """The ledger a run's status holds; an empty one where it holds none that can be read (a
        run begun before qgtrain kept one, a file edited by hand)."""
        kept = status.get("time")
        if not isinstance(kept, dict) or not isinstance(kept.get("seconds"), dict):
            return cls()
        try:
            return cls(
                {kind: float(kept["seconds"].get(kind, 0.0)) for kind in KINDS},
                int(kept.get("reached", 0)),
                int(kept.get("starts", 0)),
                float(kept["written"]) if kept.get("written") is not None else None,
            )
        except (TypeError, ValueError):
            return cls()

    def total(self) -> float:
        return sum(self.seconds.values())

    def shares(self) -> dict[str, float]:
        """Each kind's share of the run's time; training's is the goodput."""
        total = self.total()
        return {kind: s / total for kind, s in self.seconds.items()} if total > 0 else {}

    def as_json(self) -> dict[str, object]:
        return {
            "seconds": {kind: round(s, 3) for kind, s in self.seconds.items()},
            "reached": self.reached,
            "starts": self.starts,
            "written": self.written,
            "goodput": round(self.shares().get("training", 0.0), 4),
        }


class Account:
    """Rank 0's: this start's time by kind, on top of the ledger of the starts before it."""

    def __init__(self, run: Pinned, allocation_start: float | None) -> None:
        """`run`: the run folder checked at start, written only while it is still there;
        `allocation_start`: when this job's allocation began (SLURM_JOB_START_TIME), None where
        unknown (a local run: it begins with this process)."""
        self.run = run
        self.began = time.time() - (process_age_s() or 0.0)
        self._clock = time.monotonic() - (time.time() - self.began)
        self.before = Ledger.read(run.path)
        since = self.before.written if self.before.starts else allocation_start
        self.waited = max(self.began - since, 0.0) if since is not None else 0.0
        self.mine = dict.fromkeys(KINDS, 0.0)
        self.reached = self.before.reached
        self._failed = False

    def training_begins(self) -> None:
        """The first step is about to start: what came before it was the start's."""
        if not self.mine["startup"]:
            self.mine["startup"] = time.monotonic() - self._clock

    def step(self, step: int, seconds: float) -> None:
        self.mine["recomputed" if step <= self.before.reached else "training"] += seconds
        self.reached = max(self.reached, step)

    def add(self, kind: str, seconds: float) -> None:
        self.mine[kind] += seconds

    def ledger(self) -> Ledger:
        """The run's ledger as of now."""
        mine = dict(self.mine)
        mine["other"] = max(time.monotonic() - self._clock - sum(mine.values()), 0.0)
        mine["waiting"] = self.waited
        return Ledger(
            {kind: self.before.seconds[kind] + mine[kind] for kind in KINDS},
            self.reached,
            self.before.starts + 1,
            time.time(),
        )

    def write(self) -> dict[str, float]:
        """Record the ledger in status.json (not in a folder put in the run folder's place: the
        next checkpoint stops the run); returns the shares of the run's time so far, by kind. A
        write that fails (a full disk) is said once and costs the run nothing: its checkpoints say
        what matters."""
        ledger = self.ledger()
        try:
            if self.run.replaced() is None:
                rundir.write_status(self.run.path, None, time=ledger.as_json())
        except OSError as exc:
            if not self._failed:
                log.warning("the run's time is not recorded in status.json: %s", exc)
            self._failed = True
        return ledger.shares()
