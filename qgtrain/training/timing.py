"""Where the loop's wall time goes: throughput for the reports, and each kind of work measured on
its own for the deadline (a step is a step; a validation, a test evaluation and a checkpoint are not
steps).

Throughput counts training alone (waiting for data included, validation and checkpoints not), so
samples/s means the same whether or not a report falls on a validation step. On rank 0 the same
measurements go to the run's goodput account (goodput.py).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass

from .goodput import Account


@dataclass(frozen=True)
class Interval:
    """The training since the last report: steps, their wall time, and the part spent waiting for
    data; with an account, the shares of the run's time so far by kind (goodput.py)."""

    steps: int
    busy_s: float
    data_s: float
    shares: dict[str, float] | None = None


class StepTimer:
    def __init__(self, step: int, account: Account | None = None) -> None:
        self.account = account  # rank 0's
        self.recent_steps_s: collections.deque[float] = collections.deque(maxlen=20)
        self.longest_save_s = 0.0
        # per batch, from the last validation or test evaluation
        self.eval_batch_s: float | None = None
        self.test_s: float | None = None
        # the downstream tasks' whole time, the last time they ran (eval.tasks)
        self.downstream_s = 0.0
        self._reported_at = step
        self._busy_s = self._data_s = 0.0
        self._started = 0.0

    def restart(self, step: int) -> None:
        """Reports count from `step`, where this start of the run begins (after a restore)."""
        self._reported_at, self._busy_s, self._data_s = step, 0.0, 0.0
        if self.account is not None:
            self.account.training_begins()

    def start_step(self) -> None:
        self._started = time.perf_counter()

    def data_read(self, started: float) -> None:
        """The step's batches are on the device, read since `started`: only that counts as waiting
        for data (not the agreement's launch or the learning rate's update before it)."""
        self._data_s += time.perf_counter() - started

    def training_done(self, step: int) -> None:
        """The training of `step` (data, forward, backward, update): what the deadline counts as a
        step."""
        took = time.perf_counter() - self._started
        self._busy_s += took
        self.recent_steps_s.append(took)
        if self.account is not None:
            self.account.step(step, took)

    @property
    def longest_step_s(self) -> float:
        return max(self.recent_steps_s, default=0.0)

    def interval(self, step: int) -> Interval:
        """The training since the last report, and a new interval begun (rank 0 records the
        run's time)."""
        shares = self.account.write() if self.account is not None else None
        done = Interval(step - self._reported_at, self._busy_s, self._data_s, shares)
        self._reported_at, self._busy_s, self._data_s = step, 0.0, 0.0
        return done

    def close(self) -> None:
        """This start's time recorded to its end."""
        if self.account is not None:
            self.account.write()

    def saved(self, started: float) -> None:
        took = time.perf_counter() - started
        self.longest_save_s = max(self.longest_save_s, took)
        self._count("checkpoint", took)

    def downstream_done(self, started: float) -> None:
        self.downstream_s = time.perf_counter() - started
        self._count("evaluation", self.downstream_s)

    def _count(self, kind: str, seconds: float) -> None:
        if self.account is not None:
            self.account.add(kind, seconds)

    def evaluated(self, started: float, batches: int, test: bool) -> None:
        took = time.perf_counter() - started
        self._count("evaluation", took)
        if batches:
            self.eval_batch_s = took / batches
        if test:
            self.test_s = took
