"""Real time limits on the Slurm test cluster: jobs of one-minute allocations that end on their
limit, with or without the warning signal reaching the ranks, and a limit extended mid-run. They
mostly wait for Slurm's clock, so they run on the cluster's side partition (node4, node5) as a unit
of their own, beside the other cluster tests (tests/conftest.py), and the three jobs run at once."""

from __future__ import annotations

import functools
import re
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
    records,
    sbatch,
    sleep_paced,
    wait_finished,
    wait_until,
)
from tests.ranks import start_cli_ranks, wait_ranks

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]
SIDE_NODES = ("--partition=side", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1")


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
    # allocation ends on the time limit; after two such ends the job is cancelled. Finishing after a
    # requeue is the interrupted-job test's concern.
    job_id = sbatch(
        tmp_path,
        *SIDE_NODES,
        "--time=1",
        "--signal=USR2@10",
        configs=paced_forever(tmp_path),
    )
    run = tmp_path / "runs" / "preemptible"
    try:
        wait_until(lambda: rank_log(run, 0).count("resumed from") >= 2, 420, "a second resume")
    finally:
        subprocess.run(["scancel", job_id], check=True)
    return {"job": job_id, "run": run, "restarts": job(job_id)["Restarts"]}


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
    job_id = sbatch(
        tmp_path,
        *SIDE_NODES,
        "--time=1",
        "--signal=URG@10",
        configs=[*paced_forever(tmp_path), checks],
    )
    run = tmp_path / "runs" / "preemptible"
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


@pytest.fixture(scope="module")
def side_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Watched]:
    """The three jobs, submitted together."""
    return {
        watch.__name__: Watched(functools.partial(watch, tmp_path_factory.mktemp(watch.__name__)))
        for watch in (requeued_twice, completed_unsignalled, extended_mid_run)
    }


def test_a_real_time_limit_requeues_and_resumes_allocation_after_allocation(side_jobs):
    seen = side_jobs["requeued_twice"].result(560)
    job_id, run = seen["job"], seen["run"]
    assert seen["restarts"] == "2", "the same job id came back after each time limit"
    log = rank_log(run, 0)
    # Whichever comes first stops the run: the signal (10-40 s ahead) or qgtrain's own reading of
    # the limit (the steps to the next agreement, a checkpoint and a margin ahead). On a slow
    # machine the second can win when the signal comes late; either way no step may be lost.
    stops = re.findall(r"stopping at step (\d+) on (SIGUSR2|the time limit): checkpoint saved", log)
    steps = [int(step) for step, _ in stops]
    assert len(steps) == 2 and 0 < steps[0] < steps[1], [
        line for line in log.splitlines() if "stopping" in line or "resumed" in line
    ]
    for restart, stopped in enumerate(steps, start=1):
        assert f"resumed from {run / 'checkpoints' / f'step-{stopped}'}: step {stopped}" in log, (
            f"allocation {restart + 1} lost work after the time limit"
        )
        assert f"Slurm job {job_id} restart {restart}" in log
    assert wait_finished(job_id, timeout=120) == "CANCELLED"


def test_without_a_signal_validations_longer_than_many_steps_fit_and_the_job_ends_completed(
    side_jobs,
):
    """SIGURG as the warning (the ranks ignore it): a job whose signal never reaches them, stopped
    by qgtrain's own reading of the time limit. Validations take 4 s (a sleep) where a step takes a
    twentieth of that; the run needs about two 1-minute allocations. It ends COMPLETED, never
    TIMEOUT, with every loss and validation loss of an uninterrupted run of the same settings
    trained alongside on two local ranks."""
    seen = side_jobs["completed_unsignalled"].result(560)
    assert seen["local"] == [0, 0]
    assert seen["state"] == "COMPLETED"
    assert int(seen["restarts"]) >= 1, "the run needed more than one allocation"
    log = rank_log(seen["run"], 0)
    assert "on the time limit: checkpoint saved" in log and "the time limit is" in log
    want, have = records(seen["uninterrupted"]), records(seen["run"])
    for key in ("loss", "val_loss", "test_loss"):
        by_step = [{r["step"]: r[key] for r in rs if key in r} for rs in (want, have)]
        # a start also logs its first step
        assert by_step[0] and by_step[0].items() <= by_step[1].items(), key
        assert key == "loss" or by_step[0] == by_step[1], key


def test_a_time_limit_extended_mid_run_is_followed(side_jobs):
    """A 1-minute job whose warning never reaches the ranks (URG) gets a 2-minute limit once it
    trains: qgtrain reads the new end time (every 5 s here) and stops at a checkpoint before it,
    well past the minute the job started with, instead of stopping early or being killed at it. (Its
    stop margin is a tenth of the time given, so the minute would have ended training near 50 s.)"""
    seen = side_jobs["extended_mid_run"].result(560)
    log = rank_log(seen["run"], 0)
    assert "on the time limit: checkpoint saved" in log
    assert 65 < seen["stopped_at"] - seen["started"] < 120, (
        "after the old limit, before the new one"
    )
    assert "Slurm job" in log and "restart 0" in log
