"""torch.profiler over a few steps (train.profile_steps), on every rank: a slow step on the cluster
is read off a trace instead of guessed at.

Each rank writes a Chrome trace (Perfetto and chrome://tracing open it) to <run
dir>/profiles/rank_<r>-steps_<first>-<last>.json; rank 0 logs its operators' top self times. One
step before `first` runs under the profiler as a warm-up (torch.profiler's schedule discards it), so
the first profiled step does not carry the profiler's own start-up. On a GPU, train.memory_snapshot
also records every CUDA allocation over the same steps (rank_<r>-steps_<first>-<last>.pickle, for
pytorch.org/memory_viz). The profiler observes only: a profiled run trains bit for bit as an
unprofiled one (tests/test_profiles.py).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from ..config import TrainConfig
from ..foundation.files import temp_name
from ..runs.rundir import RunDir

log = logging.getLogger("qgtrain")

TOP_OPERATORS = 12
MEMORY_EVENTS = 100_000  # allocations kept by CUDA's memory history, newest first


class StepProfiler:
    """Started at the warm-up step, stepped after each applied step, finished after `last`."""

    def __init__(
        self,
        steps: tuple[int, ...],
        folder: Path,
        rank: int,
        device: torch.device,
        memory_snapshot: bool,
    ) -> None:
        self.first, self.last = steps if steps else (0, -1)
        self.folder, self.rank, self.device = folder, rank, device
        self.memory = memory_snapshot and device.type == "cuda"
        self._profile: profile | None = None
        if memory_snapshot and not self.memory:
            log.warning(
                "train.memory_snapshot records CUDA allocations; this run is on %s: the "
                "profile is written without it",
                device.type,
            )

    @classmethod
    def for_run(
        cls, train: TrainConfig, run: RunDir, rank: int, device: torch.device
    ) -> StepProfiler:
        """From the train section: train.profile_steps, train.memory_snapshot."""
        return cls(train.profile_steps, run.profiles, rank, device, train.memory_snapshot)

    @property
    def _name(self) -> str:
        return f"rank_{self.rank}-steps_{self.first}-{self.last}"

    def step_begins(self, step: int) -> None:
        if self._profile is not None or not self.first <= step + 1 <= self.last + 1:
            return
        if step > self.first:
            log.info(
                "train.profile_steps %d-%d: this start begins at step %d, past the first; "
                "not profiled",
                self.first,
                self.last,
                step,
            )
            self.first = self.last + 1  # once
            return
        warmup = 1 if step < self.first else 0
        activities = [ProfilerActivity.CPU] + (
            [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
        )
        self._profile = profile(
            activities=activities,
            record_shapes=True,
            schedule=schedule(wait=0, warmup=warmup, active=self.last - self.first + 1, repeat=1),
            on_trace_ready=self._write,
        )
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)
        self._profile.start()

    def step_done(self, step: int) -> None:
        if self._profile is None:
            return
        self._profile.step()
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Ends a profile that is still open (the run stopped inside it); its trace is written."""
        if self._profile is None:
            return
        running, self._profile = self._profile, None
        running.stop()
        if self.memory:
            _replace(self.folder / f"{self._name}.pickle", torch.cuda.memory._dump_snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)

    def _write(self, done: profile) -> None:
        self.folder.mkdir(mode=0o750, parents=True, exist_ok=True)  # within the run's own mode
        trace = self.folder / f"{self._name}.json"
        _replace(trace, done.export_chrome_trace)
        if self.rank == 0:
            key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
            table = done.key_averages().table(sort_by=key, row_limit=TOP_OPERATORS)
            log.info(
                "profile of steps %d-%d written to %s (every rank's beside it); top operators "
                "by self time:\n%s",
                self.first,
                self.last,
                trace,
                table,
            )


def _replace(target: Path, write: Callable[[str], object]) -> None:
    """torch writes a trace by opening its name, which would follow a link planted there: it
    writes an unguessable name instead, renamed over the trace's."""
    tmp = temp_name(target)
    try:
        write(str(tmp))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
