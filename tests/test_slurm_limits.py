"""Real time limits on the Slurm test cluster: jobs of one-minute allocations that end on their
limit, with or without the warning signal reaching the ranks, and a limit extended mid-run. They
mostly wait for Slurm's clock, so they run on the cluster's side partition (node4, node5), submitted
when the cluster starts (tests/slurm_side.py) and waited out while the other cluster tests run."""

from __future__ import annotations

import re

import pytest

from tests import slurm_side
from tests.helpers import rank_log, records

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


@pytest.fixture(scope="module")
def side_jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, slurm_side.Watched]:
    """The three jobs: submitted with the cluster's start, or now when only these tests run."""
    return slurm_side.start(tmp_path_factory)


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
    assert len(steps) == 3 and 0 < steps[0] < steps[1] < steps[2], [
        line for line in log.splitlines() if "stopping" in line or "resumed" in line
    ]
    for restart, stopped in enumerate(steps[:2], start=1):
        assert f"resumed from {run / 'checkpoints' / f'step-{stopped}'}: step {stopped}" in log, (
            f"allocation {restart + 1} lost work after the time limit"
        )
        assert f"Slurm job {job_id} restart {restart}" in log
    # the third allocation's stop is saved too, and not requeued
    assert "not requeued (slurm.requeue=True, restart 2 of at most 2)" in log
    assert "restart 2, step 1" not in log, "a stop is not retried as a failed step"
    assert (run / "checkpoints" / f"step-{steps[2]}").is_dir()
    assert seen["state"] != "TIMEOUT", "every allocation stopped before its limit"


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
