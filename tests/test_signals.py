"""Stop signals. Runs against: real signals to the test process (the flag), and real 2-rank `qgtrain
train` processes where one non-zero rank alone is signalled; the requeue goes to a stand-in
`scontrol` on PATH that records its arguments (the real one is exercised by the Slurm cluster
tests)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from qgtrain.foundation.errors import EXIT_REQUEUE_ME, EXIT_STOPPED
from qgtrain.runtime.deadline import Deadline
from qgtrain.runtime.signals import StopFlag
from qgtrain.runtime.slurm import (
    is_time_limit,
    job_state,
    reason_not_to_requeue,
    requeue,
    seconds_left,
)
from tests.helpers import lines_in, train_command, wait_for
from tests.ranks import start_cli_ranks, wait_ranks


def until_stopped(run: Path, *sets: str) -> list[str]:
    """A run too long to finish, with no scheduled save: it ends on a stop, at that stop's save."""
    return train_command(
        run,
        "data.name=synthetic",
        "data.seq_len=16",
        "train.batch_size=4",
        "train.max_steps=100000",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every_steps=0",
        "logging.tensorboard=false",
        *sets,
    )


def test_the_handler_only_records_and_previous_handlers_come_back():
    calls = []

    def previous(signum, frame):  # type: ignore[no-untyped-def]
        calls.append(signum)

    old = signal.signal(signal.SIGUSR2, previous)
    try:
        with StopFlag(["USR2", "TERM"]) as stop:
            assert not stop.requested
            os.kill(os.getpid(), signal.SIGUSR2)
            assert stop.requested and stop.received == ["SIGUSR2"] and calls == []
        assert signal.getsignal(signal.SIGUSR2) is previous
        os.kill(os.getpid(), signal.SIGUSR2)
        assert calls == [signal.SIGUSR2]
    finally:
        signal.signal(signal.SIGUSR2, old)


def test_requeue_reports_instead_of_raising():
    def missing(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise FileNotFoundError("scontrol")

    def refusing(cmd, **kwargs):  # type: ignore[no-untyped-def]
        return subprocess.CompletedProcess(
            cmd, 1, "", "Requested operation is presently disabled for job 9"
        )

    assert requeue("9", run=missing) == (False, "scontrol is not on PATH")
    done, message = requeue("9", run=refusing)
    assert not done and "exited 1: Requested operation is presently disabled" in message


@pytest.mark.parametrize(
    "shown, our_restart, requeue_it",
    [
        ("JobId=9 JobName=x JobState=RUNNING Reason=None Requeue=1 Restarts=0", 0, True),
        # scancel, time limit
        ("JobId=9 JobName=x JobState=COMPLETING Reason=None Requeue=1 Restarts=0", 0, False),
        ("JobId=9 JobName=x JobState=CANCELLED Reason=None Requeue=1 Restarts=2", 2, False),
        # requeued from outside
        ("JobId=9 JobName=x JobState=COMPLETING Reason=None Requeue=1 Restarts=1", 0, False),
        ("JobId=9 JobName=x JobState=PENDING Reason=BeginTime Requeue=1 Restarts=1", 1, False),
    ],
)
def test_only_a_running_job_that_slurm_has_not_requeued_is_requeued(shown, our_restart, requeue_it):
    def scontrol(cmd, **kwargs):  # type: ignore[no-untyped-def]
        return subprocess.CompletedProcess(cmd, 0, shown + "\n", "")

    assert (reason_not_to_requeue(job_state("9", run=scontrol), our_restart) is None) is requeue_it


def stand_in_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    bin_dir, calls = tmp_path / "bin", tmp_path / "scontrol-calls.txt"
    bin_dir.mkdir()
    script = bin_dir / "scontrol"
    script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    script.chmod(0o755)
    return bin_dir, calls


# fsdp shards GPT-2's blocks, so it gets a small GPT-2
MODELS = {
    "ddp": ["model.factory=tests.factories:tiny"],
    "fsdp": ["train.parallel=fsdp", "model.hidden=32", "model.heads=2", "model.layers=2"],
}


def test_a_job_started_from_a_shell_or_past_max_restarts_is_not_requeued_and_says_why():
    """srun or salloc from a shell makes a job Slurm cannot requeue (only batch jobs can be): the
    stop says so instead of asking a batch shell that does not exist to requeue it."""
    from qgtrain.config import SlurmConfig
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.runtime.slurm import decide_requeue

    calls: list[list[str]] = []

    def scontrol(args: list[str], **_: object) -> subprocess.CompletedProcess[str]:
        calls.append(args)
        return subprocess.CompletedProcess(args, 0, "JobState=RUNNING Restarts=0", "")

    step = {
        "SLURM_JOB_ID": "9",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_JOB_NODELIST": "node1",
        "SLURM_STEP_TASKS_PER_NODE": "1",
    }
    shell = decide_requeue(SlurmConfig(), from_environ(step, "node1"), scontrol)
    assert shell == (
        False,
        "this job was started by srun or salloc from a shell, not by sbatch, and Slurm "
        "requeues only batch jobs: run the same command again to resume",
    )
    assert calls == []
    assert decide_requeue(
        SlurmConfig(), from_environ({**step, "ENVIRONMENT": "BATCH"}, "node1"), scontrol
    ) == (True, "requeued job 9")
    assert calls == [["scontrol", "show", "job", "-o", "9"], ["scontrol", "requeue", "9"]]
    tenth = from_environ({**step, "ENVIRONMENT": "BATCH", "SLURM_RESTART_COUNT": "10"}, "node1")
    assert decide_requeue(SlurmConfig(max_restarts=10), tenth, scontrol) == (
        False,
        "not requeued (slurm.requeue=True, restart 10 of at most 10)",
    )
    assert len(calls) == 2, "slurm.max_restarts reached: Slurm is not asked"


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig, scontrol_on_path, expected_exit, parallel",
    [
        (signal.SIGUSR2, True, EXIT_STOPPED, "ddp"),
        (signal.SIGTERM, False, EXIT_REQUEUE_ME, "ddp"),
        (signal.SIGUSR2, True, EXIT_STOPPED, "fsdp"),
    ],
)
def test_a_signal_to_one_nonzero_rank_stops_every_rank_at_one_checkpoint_and_requeues(
    tmp_path, sig, scontrol_on_path, expected_exit, parallel
):
    bin_dir, calls = stand_in_scontrol(tmp_path)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_ARRAY_JOB_ID": "4200",
        "SLURM_ARRAY_TASK_ID": "3",
        "ENVIRONMENT": "BATCH",
        "PATH": f"{bin_dir}:{os.environ['PATH']}" if scontrol_on_path else str(empty),
    }
    run = tmp_path / "run"
    args = until_stopped(run, *MODELS[parallel])
    procs = start_cli_ranks(2, args, tmp_path, env=env)
    wait_for(lambda: lines_in(run / "metrics.jsonl") >= 5, procs, "step 5", 120, 0.05)
    signalled = time.monotonic()
    os.kill(procs[1].pid, sig)
    assert wait_ranks(procs, 60) == [expected_exit, expected_exit]
    elapsed = time.monotonic() - signalled

    saved = sorted((run / "checkpoints").iterdir())
    assert len(saved) == 1, "exactly one checkpoint, at the agreed step"
    step = json.loads((saved[0] / "manifest.json").read_text())["step"]
    assert saved[0].name == f"step-{step}"
    assert (saved[0] / "sharded").is_dir() == (parallel == "fsdp")
    logs = [(run / "logs" / f"rank_{r}.log").read_text() for r in (0, 1)]
    assert f"stopping at step {step} on a signal that reached another rank" in logs[0]
    assert f"stopping at step {step} on {signal.Signals(sig).name}" in logs[1]
    if scontrol_on_path:
        lines = calls.read_text().splitlines()
        # rank 0 alone reads the job's time limit at start, checks its state, then requeues by array
        # id
        assert lines == ["show job -o 4242", "show job -o 4242", "requeue 4200_3"]
        assert "requeued job 4200_3" in logs[0]
    else:
        assert not calls.exists()
        assert "scontrol is not on PATH" in logs[0]
    assert elapsed < 30, f"stopping took {elapsed:.1f}s"


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_sigterm_to_every_process_of_the_step_dataloader_workers_included_stops_at_one_checkpoint(
    tmp_path, parallel
):
    """What Slurm does on preemption or scancel: SIGTERM to each rank and to each of its loader
    workers."""
    run = tmp_path / "run"
    args = until_stopped(run, "data.num_workers=2", *MODELS[parallel])
    procs = start_cli_ranks(2, args, tmp_path)
    wait_for(lambda: lines_in(run / "metrics.jsonl") >= 5, procs, "step 5", 120, 0.05)
    members = subprocess.run(
        ["pgrep", "-g", ",".join(str(p.pid) for p in procs)], capture_output=True, text=True
    ).stdout.split()
    assert len(members) == 6, f"each rank and its two workers: {members}"
    for proc in procs:
        os.killpg(proc.pid, signal.SIGTERM)
    assert wait_ranks(procs, 60) == [EXIT_STOPPED, EXIT_STOPPED]
    saved = sorted((run / "checkpoints").iterdir())
    assert len(saved) == 1 and json.loads((saved[0] / "manifest.json").read_text())["step"] > 0
    assert (saved[0] / "sharded").is_dir() == (parallel == "fsdp")
    assert json.loads((run / "status.json").read_text())["status"] == "preempted"
    logs = "".join((run / "logs" / f"rank_{r}.log").read_text() for r in (0, 1))
    assert "DataLoader worker" not in logs


@pytest.mark.parametrize(
    "left, ran, limit, lead, timed_out",
    [
        (110.0, 10.0, 120.0, 120, True),  # a 2-minute job warned at its start: the time limit
        (3000.0, 60.0, 3600.0, 120, False),  # an hour left: a preemption
        # warned 150 s before the end (Slurm's 30 s tick): the time limit
        (150.0, 3450.0, 3600.0, 120, True),
        (None, 50.0, 120.0, 120, False),  # no end time known: half the limit, not submitit's -480 s
        (
            None,
            100.0,
            300.0,
            120,
            False,
        ),  # submitit's rule (threshold -300 s) called this a timeout
        (None, 3500.0, 3600.0, 120, True),
    ],
)
def test_a_preemption_is_never_counted_as_a_timeout(left, ran, limit, lead, timed_out):
    assert is_time_limit(left, ran, limit, lead) is timed_out


def test_seconds_left_reads_the_end_time_slurm_reports():
    def scontrol(cmd, **kwargs):  # type: ignore[no-untyped-def]
        return subprocess.CompletedProcess(
            cmd,
            0,
            "JobId=9 JobState=RUNNING StartTime=2026-11-23T08:00:00 "
            "EndTime=2026-11-23T09:00:00 Restarts=0\n",
            "",
        )

    now = time.mktime(time.strptime("2026-11-23T08:58:00", "%Y-%m-%dT%H:%M:%S"))
    assert seconds_left("9", run=scontrol, now=now) == 120.0
    assert (
        seconds_left("9", run=lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "no job"))
        is None
    )


def test_the_deadline_follows_a_limit_that_is_extended_while_the_job_runs():
    start = time.time()
    ends = iter([start + 1000.0, start + 5000.0])
    deadline = Deadline(
        None, None, margin_s=60.0, read_job_end=lambda: next(ends, start + 5000.0), every_s=0.05
    )
    try:
        # 100 < 50 + 60
        assert deadline.end == start + 1000.0 and deadline.due(work_s=50.0, now=start + 900.0)
        assert not deadline.due(work_s=30.0, now=start + 900.0)
        end = time.monotonic() + 5
        # `scontrol update TimeLimit=`
        while deadline.end != start + 5000.0 and time.monotonic() < end:
            time.sleep(0.02)
        assert deadline.end == start + 5000.0 and not deadline.due(work_s=50.0, now=start + 900.0)
    finally:
        deadline.close()
    short = Deadline(None, start + 120.0, margin_s=60.0)  # a 2-minute job: a margin of 12 s, not 60
    assert not short.due(work_s=1.0, now=start + 100.0) and short.due(work_s=1.0, now=start + 108.0)
    assert Deadline(start + 2000.0, start + 5000.0, 0.0).end == start + 2000.0, (
        "max_time and the limit: earlier"
    )
    assert not Deadline(None, None, 0.0).due(1e9), "no limit at all"


@pytest.mark.slow
def test_train_max_time_stops_every_rank_at_one_checkpoint_without_any_signal(tmp_path):
    run = tmp_path / "run"
    args = until_stopped(
        run,
        "model.factory=tests.factories:tiny",
        "train.max_time=8s",
        "train.stop_margin_s=1",
        "optim.schedule=constant",
    )  # extended below: no change of rate
    started = time.time()  # before the processes start: train.max_time counts from their start
    assert wait_ranks(start_cli_ranks(2, args, tmp_path), 120) == [EXIT_STOPPED, EXIT_STOPPED]
    saved = sorted((run / "checkpoints").iterdir())
    assert len(saved) == 1
    committed = (saved[0] / "manifest.json").stat().st_mtime
    logs = [(run / "logs" / f"rank_{r}.log").read_text() for r in (0, 1)]
    # On a loaded machine the start alone can pass 8 s: then the run stops at its first chances.
    first_step_s = float(
        re.search(r"([\d.]+) s from process start to the end of the first step", logs[0]).group(1)
    )
    assert committed < started + max(8.0, first_step_s + 2.0), (
        f"the checkpoint was committed {committed - started:.1f} s after the start"
    )
    step = json.loads((saved[0] / "manifest.json").read_text())["step"]
    assert f"stopping at step {step} on the time limit: checkpoint saved" in logs[0]
    assert "the time limit is" in logs[0] and "s away" in logs[0]
    assert f"stopping at step {step} on the time limit: checkpoint saved" in logs[1], (
        "rank 1 follows rank 0"
    )
    assert wait_ranks(
        start_cli_ranks(2, [*args, "train.max_time=", f"train.max_steps={step + 3}"], tmp_path), 60
    ) == [0, 0]
    assert f"resumed from {saved[0]}: step {step}" in (run / "logs" / "rank_0.log").read_text()
