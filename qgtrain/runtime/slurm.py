"""Slurm job control from inside a job: the job's state and time limit as scontrol reports them,
whether a stopped job should come back, and asking Slurm to requeue it.

Every function takes the command runner as a parameter (subprocess.run by default), never raises for
a missing or failing scontrol (containers often lack it), and says what happened instead.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable

from ..config import SlurmConfig
from .rendezvous import DistEnv

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


def job_state(job_id: str, run: Runner = subprocess.run) -> tuple[str, int] | None:
    """(JobState, Restarts) as scontrol reports them, or None when scontrol cannot say."""
    try:
        result = run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = re.search(r"\bJobState=(\S+)", result.stdout)
    restarts = re.search(r"\bRestarts=(\d+)", result.stdout)
    if not state:
        return None
    return state.group(1), int(restarts.group(1)) if restarts else 0


def seconds_left(
    job_id: str, run: Runner = subprocess.run, now: float | None = None
) -> float | None:
    """Seconds until the job's time limit, from scontrol's EndTime (local time), or None if
    unknown."""
    try:
        shown = run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    end = re.search(r"\bEndTime=(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)", shown)
    if not end:
        return None
    return time.mktime(time.strptime(end.group(1), "%Y-%m-%dT%H:%M:%S")) - (
        time.time() if now is None else now
    )


def is_time_limit(left_s: float | None, ran_s: float, limit_s: float, lead_s: float) -> bool:
    """Whether a stop signal is the warning before the time limit (a timeout) rather than a
    preemption.

    The warning comes `lead_s` before the end, so with the end known that is the test. Without it,
    the run time decides against a threshold that is never below half the limit: submitit's own
    rule, min(0.8 x limit, limit - 10 min), is negative for jobs under 10 minutes and counts every
    preemption as a timeout, using up the timeout budget.
    """
    if left_s is not None:
        return left_s <= lead_s + 60
    return ran_s >= max(limit_s - lead_s - 60, 0.5 * limit_s)


def reason_not_to_requeue(state: tuple[str, int] | None, our_restart: int) -> str | None:
    """Why a job that stopped at a checkpoint must not be requeued by us, or None to requeue it.

    Only a job that is still RUNNING asked for this (the warning signal before the time limit). A
    job Slurm has already requeued (scontrol requeue from outside, preemption with requeue) shows a
    higher restart count while its old allocation completes; a job being ended (scancel, which also
    sends SIGTERM, or the time limit itself) shows COMPLETING, CANCELLED or TIMEOUT and must stay
    ended.
    """
    if state is None:
        return None
    name, restarts = state
    if restarts > our_restart or name in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
        return "Slurm has already requeued the job"
    if name != "RUNNING":
        return f"the job is ending ({name}: cancelled, or stopped by Slurm), so it is not requeued"
    return None


def requeue(requeue_id: str, run: Runner = subprocess.run) -> tuple[bool, str]:
    """Ask Slurm to requeue this job. Returns (done, what happened) and never raises."""
    try:
        result = run(
            ["scontrol", "requeue", requeue_id], capture_output=True, text=True, timeout=60
        )
    except FileNotFoundError:
        return False, "scontrol is not on PATH"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"scontrol requeue {requeue_id} failed: {exc}"
    if result.returncode != 0:
        return (
            False,
            f"scontrol requeue {requeue_id} exited {result.returncode}: {result.stderr.strip()}",
        )
    return True, f"requeued job {requeue_id}"


def decide_requeue(
    slurm: SlurmConfig, env: DistEnv, run: Runner = subprocess.run
) -> tuple[bool | None, str]:
    """Rank 0, after an agreed stop at a checkpoint (or any surviving rank, after a machine failure
    under a launcher that runs one step): requeue if this is a running batch job that should come
    back. Returns (True if requeued, False if it should not be, None if it should but could not be
    from here: the batch shell then does it) and what happened, for the log."""
    if not env.in_slurm_job:
        return False, "run the same command again to resume"
    if not env.batch_job:
        return False, (
            "this job was started by srun or salloc from a shell, not by sbatch, and Slurm "
            "requeues only batch jobs: run the same command again to resume"
        )
    if not slurm.requeue or env.restart_count >= slurm.max_restarts:
        return False, (
            f"not requeued (slurm.requeue={slurm.requeue}, restart {env.restart_count} of at most "
            f"{slurm.max_restarts})"
        )
    reason = reason_not_to_requeue(job_state(str(env.job_id), run), env.restart_count)
    if reason:
        return False, reason
    done, message = requeue(str(env.requeue_id), run)
    return (True if done else None), message
