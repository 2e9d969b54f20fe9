"""When a job must have stopped, even if no signal ever comes: the Slurm time limit or
train.max_time.

Signals get lost (a site that sends none, a `--signal=B:` that reaches only the batch shell, a
launcher in between), and then the hard limit kills the job with everything since the last
checkpoint. So rank 0 keeps the deadline itself and the trainer stops, at a step agreed by all
ranks, while the time left still holds the next steps, the checkpoint, its commit and the requeue,
plus a margin. The Slurm limit is read again every few minutes in a background thread: an admin may
extend it while the job runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ..config import TrainConfig
from ..foundation.durations import duration_s
from .rendezvous import DistEnv
from .startup import process_age_s


class Deadline:
    def __init__(
        self,
        local_end: float | None,
        job_end: float | None,
        margin_s: float,
        read_job_end: Callable[[], float | None] | None = None,
        every_s: float = 300.0,
        started: float | None = None,
    ) -> None:
        """`local_end`: from train.max_time; `job_end`: the Slurm limit now (Unix times, None if
        none); `read_job_end` reads the Slurm limit again, every `every_s` seconds; `started`: when
        this process started (default now)."""
        self.local_end, self.job_end, self.margin_s = local_end, job_end, margin_s
        self.started = time.time() if started is None else started
        self._stopped = threading.Event()
        if read_job_end is not None:
            if job_end is None:
                self.job_end = read_job_end()
            threading.Thread(
                target=self._follow,
                args=(read_job_end, every_s),
                name="qgtrain-deadline",
                daemon=True,
            ).start()

    @property
    def end(self) -> float | None:
        ends = [e for e in (self.local_end, self.job_end) if e is not None]
        return min(ends) if ends else None

    def left_s(self, now: float | None = None) -> float | None:
        end = self.end
        return None if end is None else end - (time.time() if now is None else now)

    def given_s(self) -> float | None:
        """The time this process was given, from its start to the end (None without an end)."""
        end = self.end
        return None if end is None else end - self.started

    def due(self, work_s: float, now: float | None = None) -> bool:
        """Whether `work_s` (the steps until the next agreement, a checkpoint) plus the margin no
        longer fit.

        The margin is at most a tenth of the time this process was given, so a short job still
        trains (a 2-minute test job would otherwise stop at its first step, requeue after
        requeue)."""
        end, left = self.end, self.left_s(now)
        if end is None or left is None:
            return False
        return left <= work_s + min(self.margin_s, 0.1 * max(end - self.started, 0.0))

    def close(self) -> None:
        self._stopped.set()

    def _follow(self, read_job_end: Callable[[], float | None], every_s: float) -> None:
        while not self._stopped.wait(every_s):
            end = read_job_end()
            if end is not None:
                self.job_end = end


def deadline_for(
    train: TrainConfig, env: DistEnv, seconds_left: Callable[[], float | None]
) -> Deadline:
    """Rank 0's: train.max_time from this process's start, and the Slurm job's limit (`seconds_left`
    reads it again now and then); the other ranks follow rank 0's agreed decision and keep none."""
    if not env.is_main:
        return Deadline(None, None, train.stop_margin_s)
    max_time = duration_s(train.max_time) if train.max_time else None
    started = time.time() - (process_age_s() or 0.0)
    local_end = started + max_time if max_time else None
    if not env.in_slurm_job:
        return Deadline(local_end, None, train.stop_margin_s, started=started)

    def job_end() -> float | None:
        left = seconds_left()
        return None if left is None else time.time() + left

    return Deadline(
        local_end, env.job_end_time, train.stop_margin_s, job_end, train.time_limit_check_s, started
    )
