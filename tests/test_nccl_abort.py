"""A collective that times out or breaks on NCCL aborts the process (no Python error, no failure
note): what each rank is told to do, and how `qgtrain recover` recognises the abort from srun's
report and the Flight Recorder dumps in the run directory. Runs against: srun's messages in the form
srun writes a task's end (strsignal(SIGABRT) = "Aborted", " (core dumped)" where a core was written,
128 + 6 = 134 for its own exit), tables of exits and dump files, and `qgtrain recover` as
train.slurm runs it over a real run directory."""

from __future__ import annotations

import json

import pytest

from qgtrain.launch import aborts
from qgtrain.launch.recovery import Decision, decide
from qgtrain.launch.srun_log import TaskFailure, task_failures
from qgtrain.runs import rundir
from qgtrain.runtime import comms
from qgtrain.runtime.rendezvous import DistEnv
from tests.helpers import cli
from tests.ranks import ROOT

# 2 nodes x 4 GPUs: rank 5's watchdog aborted it first; srun then took the step down
# (--kill-on-bad-exit).
ABORTED = """srun: error: gpu02: task 5: Aborted (core dumped)
srun: launch/slurm: _step_signal: Terminating StepId=48872311.0
slurmstepd: error: *** STEP 48872311.0 ON gpu01 CANCELLED AT 2026-11-25T03:12:09 ***
srun: error: gpu01: tasks 0-3: Killed
srun: error: gpu02: tasks 4,6-7: Killed
srun: Force Terminated StepId=48872311.0
"""
# The same through a container runtime that turns the signal into an exit status.
WRAPPED = (
    "srun: error: gpu02: task 5: Exited with exit code 134\nsrun: error: gpu01: tasks 0-3: Killed\n"
)
BOTH_ABORTED = (
    "srun: error: gpu01: task 1: Aborted\nsrun: error: gpu02: task 6: Aborted (core dumped)\n"
)
KILLED = "srun: error: gpu02: task 5: Killed\nsrun: error: gpu01: tasks 0-3: Killed\n"
ALL_BUT_5 = [f"rank_{r}" for r in (0, 1, 2, 3, 4, 6, 7)]


def test_srun_s_task_lines_are_read_one_rank_each():
    assert [(f.node, f.rank, f.how) for f in task_failures(ABORTED)] == [
        ("gpu02", 5, "Aborted (core dumped)"),
        *(("gpu01", r, "Killed") for r in range(4)),
        *(("gpu02", r, "Killed") for r in (4, 6, 7)),
    ]


def test_only_files_named_prefix_and_rank_are_dumps():
    names = ["rank_3", "rank_12", "rank_x", "rank_4.tmp", "other_1", "failure-1", "rank_"]
    assert aborts.dumped_ranks(names, "rank_") == (3, 12)


# srun's report, srun's exit, the dump files, world size -> kind, aborted ranks, dumped ranks,
# silent ranks
DIAGNOSES = [
    (ABORTED, 134, ALL_BUT_5, 8, ("collective", (5,), (0, 1, 2, 3, 4, 6, 7), (5,))),
    (WRAPPED, 134, [f"rank_{r}" for r in range(8)], 8, ("collective", (5,), tuple(range(8)), ())),
    (
        BOTH_ABORTED,
        137,
        ["rank_0", "rank_1", "rank_2", "rank_3"],
        4,
        ("collective", (1, 6), (0, 1, 2, 3), ()),
    ),
    # srun's words lost: its exit says it
    ("", 134, ["rank_0", "rank_1"], 2, ("collective", (), (0, 1), ())),
    # no dump here: the job turned it off or sent it elsewhere
    (ABORTED, 134, [], 8, ("abort", (5,), (), ())),
    (KILLED, 137, ["rank_0"], 8, ("dumps", (), (0,), tuple(range(1, 8)))),
    (KILLED, 137, [], 8, None),
    ("srun: error: gpu01: task 0: Exited with exit code 1\n", 1, [], 2, None),
]


@pytest.mark.parametrize("srun_log, exit_code, names, world, expected", DIAGNOSES)
def test_an_abort_with_dumps_is_an_nccl_collective_failure(
    srun_log, exit_code, names, world, expected
):
    exits = {f.rank: f.how for f in task_failures(srun_log)}
    dumped = aborts.dumped_ranks(names, "rank_")
    found = aborts.diagnose(exits, exit_code, dumped, world, "/runs/a/nccl/failure-1")
    assert (found and (found.kind, found.aborted, found.dumped, found.silent)) == expected


def test_the_reason_names_the_ranks_and_the_dumps_and_the_abort_is_retried():
    exits = {5: "Aborted (core dumped)", 0: "Killed"}
    nccl = aborts.diagnose(exits, 134, (0, 1, 2, 3, 4, 6, 7), 8, "/r/nccl/f-1")
    assert nccl is not None
    assert nccl.text() == (
        "an NCCL collective failed or timed out, the machine's failure: rank(s) 5 aborted "
        "(SIGABRT, exit 134, from NCCL's watchdog); the Flight Recorder dumps of rank(s) 0-4, 6-7 "
        "are in /r/nccl/f-1: `torchfrtrace /r/nccl/f-1` says which rank stopped in which "
        "collective; rank(s) 5 left no dump: they died or hung before they could write one"
    )
    died = TaskFailure("gpu02", 5, "Aborted (core dumped)")
    assert decide({}, died, 0, 2, 0, 20, True, {"gpu02": 1}, 1, nccl) == Decision(
        "retry", f"{nccl.text()}; retry 1 of 2 in this allocation"
    )
    own = {1: {"message": "ValueError: sample 17 has no label", "retryable": False}}
    reason = decide(own, died, 0, 2, 0, 20, True, {"gpu02": 1}, 1, nccl).reason
    assert reason.startswith("rank 1 failed on its own")


def _recover(tmp_path, srun_log: str, exit_code: int, attempt: int):  # type: ignore[no-untyped-def]
    """`qgtrain recover` with the arguments train.slurm's run_steps passes
    (qgtrain/launch/sbatch.py)."""
    said = tmp_path / f"srun-{attempt}.txt"
    said.write_text(srun_log)
    return cli(
        "recover",
        "--config",
        str(ROOT / "config.yaml"),
        "--run-dir",
        str(tmp_path / "run"),
        "--exit-code",
        str(exit_code),
        "--attempt",
        str(attempt),
        "--srun-log",
        str(said),
        "--restart",
        "0",
        "--ranks",
        "8",
        "--partition",
        "",
        cwd=tmp_path,
    )


def test_qgtrain_recover_names_the_aborted_ranks_and_keeps_each_failure_s_dumps(tmp_path):
    run = rundir.RunDir(tmp_path / "run")
    run.nccl_dumps.parent.mkdir(parents=True)
    rundir.write_status(run.path, "running", restart=0)
    for name in ALL_BUT_5:
        (run.nccl_dumps.parent / name).write_bytes(b"pickled dump")
    first = _recover(tmp_path, ABORTED, 134, 0)
    assert first.returncode == 0 and first.stdout == "retry\n", first.stderr
    kept = run.nccl_dumps.parent / "failure-1"
    assert sorted(p.name for p in kept.iterdir()) == ALL_BUT_5
    assert first.stderr.startswith(
        "qgtrain: the step failed (exit 134): an NCCL collective failed or timed out, "
        "the machine's failure: rank(s) 5 aborted"
    )
    assert (
        f"are in {kept}: `torchfrtrace {kept}`" in first.stderr
        and "rank(s) 5 left no dump" in first.stderr
    )
    # a second failure, told apart
    (run.nccl_dumps.parent / "rank_2").write_bytes(b"the next failure's")
    second = _recover(tmp_path, "srun: error: gpu01: task 2: Aborted\n", 134, 1)
    assert second.stdout == "retry\n" and (run.nccl_dumps.parent / "failure-2" / "rank_2").is_file()
    failures = json.loads(run.status.read_text())["failures"]
    assert [f["nccl"] for f in failures] == [
        {
            "kind": "collective",
            "aborted": [5],
            "dumped": [0, 1, 2, 3, 4, 6, 7],
            "silent": [5],
            "dumps": str(kept),
        },
        {
            "kind": "collective",
            "aborted": [2],
            "dumped": [2],
            "silent": [0, 1, 3, 4, 5, 6, 7],
            "dumps": str(run.nccl_dumps.parent / "failure-2"),
        },
    ]
    assert [(f["rank"], f["how"], f["action"]) for f in failures] == [
        (5, "Aborted (core dumped)", "retry"),
        (2, "Aborted", "retry"),
    ]
    assert failures[0]["reason"] == (
        first.stderr.partition(": ")[2].partition("(exit 134): ")[2].strip()
    )


def test_nccl_is_told_to_abort_the_process_unless_the_job_chose():
    assert comms.error_handling(DistEnv()) == ({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}, "3")
    # torchrun's agent sets 1
    torchrun = DistEnv(comm_env=(("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),))
    assert comms.error_handling(torchrun) == ({}, "1")
    assert (
        "ends this process with SIGABRT (exit 134) (TORCH_NCCL_ASYNC_ERROR_HANDLING=3)"
        in comms.on_failed_collective("3", own=False)
    )
    assert (
        "does not end this process (TORCH_NCCL_ASYNC_ERROR_HANDLING=0 from the environment): "
        "it may wait"
    ) in comms.on_failed_collective("0", own=True)
