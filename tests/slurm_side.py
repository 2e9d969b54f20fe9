"""The side partition's jobs (node4, node5) of tests/test_slurm_limits.py: three one-minute jobs
that mostly wait for Slurm's clock. The cluster fixture (conftest.slurm_cluster) submits them as
soon as the cluster is up, each watched on a thread of its own, so their minutes pass while the
default partition's tests run; the limits tests, later in the same unit of work, read what the
watchers saw."""

from __future__ import annotations

import functools
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import (
    ROOT,
    job,
    logged_step,
    overlay,
    rank_log,
    sbatch,
    sleep_paced,
    wait_finished,
    wait_until,
)
from tests.ranks import start_cli_ranks, wait_ranks

SIDE_NODES = ("--partition=side", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1")
_started: dict[str, Watched] = {}


def paced_forever(tmp_path: Path) -> list[Path]:
    """jobs/preemptible.yaml's run, far longer than any allocation, each step a sleep that spares
    the CPUs."""
    return [
        ROOT / "config.yaml",
        ROOT / "jobs" / "cpu.yaml",
        ROOT / "jobs" / "preemptible.yaml",
        overlay(tmp_path, 10**7),
        sleep_paced(tmp_path),
    ]


def submit_paced(tmp_path: Path, signal: str, settings: Path) -> tuple[str, Path]:
    """paced_forever with `settings` on top as a one-minute job warned by `signal` 10 s ahead."""
    job_id = sbatch(
        tmp_path,
        *SIDE_NODES,
        "--time=1",
        f"--signal={signal}@10",
        configs=[*paced_forever(tmp_path), settings],
    )
    return job_id, tmp_path / "runs" / "preemptible"


class Watched(threading.Thread):
    """A job's part that must happen while it runs (cancel it after its second resume, extend its
    limit once it trains), on a thread of its own: the three jobs run side by side, each holding one
    CPU of each side node, so their minute-long allocations are waited out together. The test
    joins it and reads what it saw, or the exception it ended with."""

    def __init__(self, watch: Callable[[], dict[str, Any]]) -> None:
        super().__init__(daemon=True)
        self.watch, self.seen = watch, dict[str, Any]()
        self.failed: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.seen = self.watch()
        except BaseException as exc:  # the test raises it where it joins
            self.failed = exc

    def result(self, timeout: float) -> dict[str, Any]:
        self.join(timeout)
        assert not self.is_alive(), f"still watching after {timeout} s"
        if self.failed is not None:
            raise self.failed
        return self.seen


def requeued_twice(tmp_path: Path) -> dict[str, Any]:
    # --time=1 with the signal 10 s ahead: Slurm's 30 s tick delivers it 10-40 s before the limit.
    # The run is far longer than a minute (its steps are a sleep, sparing the CPUs), so every
    # allocation ends on the time limit; slurm.max_restarts 2 ends the job at its third (a watcher
    # that cancelled it after the second resume raced a third requeue on a loaded machine, where a
    # late start leaves seconds between a resume and the next signal). Finishing after a requeue is
    # the interrupted-job test's concern.
    bounded = tmp_path / "bounded.yaml"
    bounded.write_text("slurm: {max_restarts: 2}\n")
    job_id, run = submit_paced(tmp_path, "USR2", bounded)
    try:
        state = wait_finished(job_id, timeout=420)
    finally:
        subprocess.run(["scancel", job_id], check=False)
    return {"job": job_id, "run": run, "restarts": job(job_id)["Restarts"], "state": state}


def completed_unsignalled(tmp_path: Path) -> dict[str, Any]:
    task = tmp_path / "task.yaml"
    task.write_text(
        f"task: {{factory: '{ROOT / 'tests' / 'tasks.py'}:slow_evaluation', options: {{size: 4096, "
        "step_s: 0.05, eval_batch_s: 0.5}}\n"
        "train: {max_steps: 800, eval_every: 100, eval_batches: 8, log_every: 20, cpu_threads: 1}\n"
        "early_stopping: {patience: 0}\ncheckpoint: {every_steps: 0}\n"
    )
    configs = [ROOT / "config.yaml", ROOT / "jobs" / "cpu.yaml", overlay(tmp_path, 800), task]
    job_id = sbatch(tmp_path, *SIDE_NODES, "--time=1", "--signal=URG@10", configs=configs)
    local = start_cli_ranks(
        2,
        [
            "train",
            *[a for c in configs for a in ("--config", str(c))],
            "--run-dir",
            str(tmp_path / "uninterrupted"),
        ],
        tmp_path,
        log_prefix="local",
    )
    return {
        "local": wait_ranks(local, 600),
        "state": wait_finished(job_id, timeout=900),
        "restarts": job(job_id)["Restarts"],
        "run": tmp_path / "runs" / "cpu",
        "uninterrupted": tmp_path / "uninterrupted",
    }


def extended_mid_run(tmp_path: Path) -> dict[str, Any]:
    checks = tmp_path / "checks.yaml"
    checks.write_text("train: {time_limit_check_s: 5}\n")
    job_id, run = submit_paced(tmp_path, "URG", checks)
    try:
        wait_until(lambda: logged_step(run) >= 1, 120, "training to start")
        started = time.mktime(time.strptime(job(job_id)["StartTime"], "%Y-%m-%dT%H:%M:%S"))
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=2"], check=True)
        wait_until(
            lambda: "stopping at step" in rank_log(run, 0), 180, "the stop before the new limit"
        )
        stopped_at = time.time()
    finally:
        subprocess.run(["scancel", job_id], check=True)
    return {"run": run, "started": started, "stopped_at": stopped_at}


def start(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Watched]:
    """The three jobs, submitted together the first time this is called; the same watchers after."""
    if not _started:
        _started.update(
            {
                watch.__name__: Watched(
                    functools.partial(watch, tmp_path_factory.mktemp(watch.__name__))
                )
                for watch in (requeued_twice, completed_unsignalled, extended_mid_run)
            }
        )
    return _started
