"""A user's own code that raises (a task function, a loss) as the user meets it: one `qgtrain:
error:` line naming their function, where it is, the exception and the log holding its traceback;
the traceback in that rank's log; the failure the run's own, which the batch script does not retry.
Runs against: real `qgtrain train` processes, 1 and 2 ranks (gloo), and `qgtrain recover`'s
decision on the note the failing rank left."""

from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import pytest

from qgtrain.launch import recovery
from qgtrain.runs.lifecycle import read_note
from qgtrain.runs.rundir import RunDir
from tests.helpers import ROOT, cli, train_command
from tests.raising_tasks import build
from tests.ranks import start_cli_ranks, wait_ranks

LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \[rank \d+\] ")


def not_retried(run: Path, rank: int) -> bool:
    """What `qgtrain recover` (train.slurm, after the step failed) decides from the rank's note."""
    note = read_note(RunDir(run), rank)
    assert note is not None and note["retryable"] is False, note
    decision = recovery.decide({rank: note}, None, 0, 2, 0, 3, True, {}, None)
    return decision.action == "end"


@pytest.mark.slow
def test_a_loss_that_raises_on_rank_one_is_told_by_rank_one_with_its_traceback_in_its_log(
    tmp_path,
):
    run = tmp_path / "run"
    procs = start_cli_ranks(
        2,
        train_command(
            run,
            "task=tests.tasks:raises_on_rank_one",
            "task.options.where=loss",
            "train.batch_size=8",
            "train.max_steps=12",
            "logging.tensorboard=false",
            "train.collective_timeout_s=120",
        ),
        tmp_path,
    )
    assert wait_ranks(procs, 100) == [1, 1]
    log = run / "logs" / "rank_1.log"
    traceback = log.read_text()
    assert "Traceback (most recent call last)" in traceback, traceback
    assert f'File "{ROOT / "tests" / "tasks.py"}", line ' in traceback, traceback
    assert 'raise ValueError("sample 17 has no label")' in traceback, traceback
    said = (tmp_path / "rank-1.out").read_text()
    assert "Traceback" not in said, said
    assert re.fullmatch(
        r"qgtrain: error: ValueError: sample 17 has no label, raised in "
        rf"raises_on_rank_one\.<locals>\.loss \({re.escape(str(ROOT / 'tests' / 'tasks.py'))}:"
        rf"\d+\), at line \d+; its traceback is in {re.escape(str(log))}\. Your code's failure, "
        r"not the machine's: not retried",
        said.strip().splitlines()[-1],
    ), said
    rank0 = (tmp_path / "rank-0.out").read_text().strip().splitlines()[-1]
    assert rank0.startswith(
        "qgtrain: error: rank 1 failed: ValueError: sample 17 has no label, raised in "
        "raises_on_rank_one.<locals>.loss"
    ), rank0
    assert f"(its log: {log}); rank 0 stopped with it" in rank0, rank0
    assert not_retried(run, 1)


@pytest.mark.slow
def test_a_build_that_raises_ends_in_one_line_naming_it_and_its_log(tmp_path):
    run = tmp_path / "run"
    done = cli(
        *train_command(
            run, "task=tests.raising_tasks:build", "train.max_steps=4", "logging.tensorboard=false"
        ),
        cwd=tmp_path,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    lines, defined = inspect.getsourcelines(build)
    opened = defined + next(i for i, line in enumerate(lines) if "open(" in line)
    here = ROOT / "tests" / "raising_tasks.py"
    log = run / "logs" / "rank_0.log"
    assert done.stderr.strip().splitlines()[-1] == (
        "qgtrain: error: FileNotFoundError: [Errno 2] No such file or directory: "
        f"'missing.jsonl', raised in build ({here}:{defined}), at line {opened}; its traceback "
        f"is in {log}. Your code's failure, not the machine's: not retried"
    ), done.stderr[-3000:]
    others = [line for line in done.stderr.splitlines() if not LOG_LINE.match(line)]
    assert len(others) < 5 and "Traceback" not in done.stderr, done.stderr[-3000:]
    traceback = log.read_text()
    assert "Traceback (most recent call last)" in traceback, traceback
    assert f'File "{here}", line {opened}, in build' in traceback, traceback
    assert traceback.rstrip().splitlines()[-1].endswith("not retried")
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and status["retryable"] is False, status
    assert not_retried(run, 0)
