"""Every use of submitit's private members, in one place, so a new submitit release breaks loudly
here.

submitit has no public way to: know which signal its job handler listens for, tell that handler
whether a stop was the time limit or a preemption (it guesses from run time, and charges every guess
as a timeout), give an executor a job class of our own, read a multi-task job's per-task jobs, or
change how job states are read when there is no accounting (sacct) behind the cluster.
pyproject.toml bounds submitit to the minor version these were read against; tests/test_submitit.py
fails when one of them disappears.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import Any

from submitit.core.core import Job
from submitit.core.job_environment import JobEnvironment, SignalHandler
from submitit.slurm.slurm import SlurmInfoWatcher, SlurmJob

PRIVATE_MEMBERS: dict[type, tuple[str, ...]] = {  # what qgtrain reads, sets or replaces, by class
    JobEnvironment: ("_usr_sig",),
    SignalHandler: ("_start_time", "has_timed_out"),
    SlurmInfoWatcher: (
        "_make_command",
        "_num_calls",
        "_info_dict",
        "_last_status_check",
        "_registered",
        "_finished",
    ),
    SlurmJob: ("_sub_jobs",),
}


def missing_members() -> list[str]:
    """The members above that the installed submitit lacks. Attributes set on instances are looked
    for where submitit sets them, in the source of the class and its bases (`self.<name> =`)."""
    import inspect
    import re

    missing = []
    for cls, names in PRIVATE_MEMBERS.items():
        source = "".join(
            inspect.getsource(base)
            for base in cls.__mro__
            if base.__module__.startswith("submitit")
        )
        for name in names:
            if not hasattr(cls, name) and not re.search(rf"self\.{name}\s*(:[^=]*)?=", source):
                missing.append(f"{cls.__name__}.{name}")
    return missing


def preemption_signal() -> int:
    """The signal submitit's job handler requeues on (SUBMITIT_PREEMPT_SIGNAL, USR2 by default)."""
    return int(JobEnvironment._usr_sig())


def decide_timed_out(handler: Any, timed_out: Callable[[float], bool]) -> None:
    """Make submitit's handler count this stop as a timeout or a preemption by our rule, given the
    job's run time, instead of its own (which counts every preemption of a short job as a
    timeout)."""
    owner = getattr(handler, "__self__", None)  # the bound method's SignalHandler
    if isinstance(owner, SignalHandler):
        ran_s = time.time() - owner._start_time
        owner.has_timed_out = lambda: timed_out(ran_s)  # type: ignore[method-assign]


def use_job_class(executor: Any, job_class: type[SlurmJob[Any]]) -> None:
    """Jobs from this AutoExecutor come back as `job_class` (same submission path, our waits)."""
    executor._executor.job_class = job_class


def task_jobs(job: SlurmJob[Any]) -> list[Job[Any]]:
    """The per-task jobs of a multi-task job (empty for one task)."""
    return list(job._sub_jobs)


class FallbackWatcher(SlurmInfoWatcher):
    """Job states from sacct when accounting works, else `fallback(job ids)` (squeue, scontrol); a
    job none of them knows any more is reported LOST, not UNKNOWN, so waiting on it ends."""

    fallback: Callable[[list[str]], dict[str, dict[str, str]]] = staticmethod(lambda ids: {})

    def update(self) -> None:
        command = self._make_command()
        if command is None:
            return
        self._num_calls += 1
        ids = sorted({arg for arg in command if arg.isdigit()})
        self._info_dict.update(self._from_sacct(command) or type(self).fallback(ids))
        for job_id in ids:
            self._info_dict.setdefault(job_id, {"JobID": job_id, "State": "LOST"})
        self._last_status_check = time.time()
        for job_id in self._registered - self._finished:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def _from_sacct(self, command: list[str]) -> dict[str, dict[str, str]]:
        try:
            out = subprocess.run(command, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return {}
        if out.returncode != 0 or "accounting storage is disabled" in out.stdout + out.stderr:
            return {}
        return dict(self.read_info(out.stdout))
