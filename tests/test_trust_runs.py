"""A run folder in a shared project folder is written and run only when no one else can write it:
one another user made first (with a link planted at a job file) is refused in one line before
anything is written, a group run under umask 002 comes out without group write bits, and a log is
never appended to through a link. Runs against: real folders made by another real user (`nobody`,
through setpriv, as root), real `qgtrain submit` and `qgtrain train` processes (a script stands in
for sbatch), and real links."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from qgtrain.foundation import files
from qgtrain.foundation.errors import QgtrainError
from qgtrain.launch import recovery, runfrom, stages
from qgtrain.runs import rundir
from tests.helpers import TINY, cli, one_error_line, stand_in_sbatch, tiny_config
from tests.ranks import ROOT

AS_NOBODY = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="acting as another user (nobody) needs root"
)
ORIGINAL = "# the user's ~/.bashrc\n"


@pytest.fixture
def shared() -> Iterator[Path]:
    """A folder every user can write, as a group project folder is (pytest's tmp_path sits under
    a folder only root can enter)."""
    folder = Path(tempfile.mkdtemp(prefix="qgtrain-shared-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def as_nobody(script: str) -> None:
    subprocess.run([*AS_NOBODY, "sh", "-c", f"umask 022; {script}"], check=True)


def bashrc(tmp_path: Path) -> Path:
    """A file of the user's, standing in for ~/.bashrc, that a planted link points at."""
    mine = tmp_path / "bashrc"
    mine.write_text(ORIGINAL)
    return mine


@needs_root
def test_submit_into_a_run_folder_another_user_made_is_refused_and_writes_nothing(tmp_path, shared):
    mine = bashrc(tmp_path)
    run = shared / "runs" / "demo"
    as_nobody(f"mkdir -p {run}/slurm && ln -s {mine} {run}/slurm/job.sbatch")
    sets = ["--set", f"logging.runs_dir={shared / 'runs'}", "train.run_name=demo"]
    done = cli("submit", *sets, cwd=tmp_path, env=stand_in_sbatch(tmp_path))
    line = one_error_line(done)
    assert f"the run directory {run} is not safe to write or run jobs in: {run}" in line
    assert "belongs to uid 65534, not to you (uid 0) (owner nobody, mode 0755)" in line
    assert "HINT: remove it, or choose another train.run_name" in line
    assert mine.read_text() == ORIGINAL
    assert sorted(p.name for p in run.rglob("*")) == ["job.sbatch", "slurm"]
    assert not (tmp_path / "sbatch.log").exists(), "sbatch never ran"


@needs_root
def test_train_into_a_run_folder_another_user_made_is_refused_and_writes_nothing(tmp_path, shared):
    mine = bashrc(tmp_path)
    run = shared / "demo"  # made to look like a run that started before
    as_nobody(
        f'mkdir -p {run}/logs && echo \'{{"run_id": "x"}}\' > {run}/run.json && '
        f"ln -s {mine} {run}/logs/rank_0.log"
    )
    done = cli("train", "--run-dir", str(run), "--set", *TINY, "train.max_steps=1", cwd=tmp_path)
    line = one_error_line(done)
    assert f"{run} belongs to uid 65534, not to you (uid 0) (owner nobody, mode 0755)" in line
    assert mine.read_text() == ORIGINAL
    assert sorted(p.name for p in run.rglob("*")) == ["logs", "rank_0.log", "run.json"]


@needs_root
def test_next_stage_recover_and_snapshot_refuse_a_run_folder_another_user_made(tmp_path, shared):
    run = shared / "demo"
    as_nobody(
        f"mkdir -p {run}/stages && echo '#!/bin/sh' > {run}/stages/stage-2.sbatch && "
        f'echo \'{{"id": "c", "submit_dir": "/", "stages": [{{"run_dir": "{run}"}}, {{}}]}}\' '
        f'> {run}/stages/chain.json && echo \'{{"status": "finished"}}\' > {run}/status.json'
    )
    calls: list[object] = []
    with pytest.raises(QgtrainError, match="belongs to uid 65534") as refused:
        stages.next_stage(run / "stages", 1, 0, run=lambda *a, **k: calls.append(a))
    assert "\n" not in str(refused.value) and calls == []
    with pytest.raises(QgtrainError, match="belongs to uid 65534"):
        recovery.recover(run, "", 1, 0, 0, 1, tiny_config().slurm, None)
    cfg = tiny_config(f"logging.runs_dir={shared}", "train.run_name=demo")
    with pytest.raises(QgtrainError, match="belongs to uid 65534"):
        runfrom.for_attempt(cfg, "7", tmp_path)  # `qgtrain snapshot`, at a job's start
    assert sorted(p.name for p in run.rglob("*")) == [
        "chain.json",
        "stage-2.sbatch",
        "stages",
        "status.json",
    ]


def modes(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): oct(stat.S_IMODE(p.lstat().st_mode)) for p in run.rglob("*")}


def test_a_group_run_under_umask_002_gets_no_group_or_other_write_bit(tmp_path):
    """`qgtrain submit --then` with logging.shared under the umask of many group project folders:
    the run folder is the group's to read (0750), and nothing in code/, slurm/, stages/ is
    writable by anyone but its owner."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "task.py").write_text("VALUE = 1\n")
    (work / "config.yaml").write_text("logging: {shared: true}\ntrain: {run_name: demo}\n")
    (work / "more.yaml").write_text("optim: {lr: 0.0001, min_lr: 0.00001}\n")
    env = {**os.environ, **stand_in_sbatch(tmp_path), "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "qgtrain", "submit", "--then", "more.yaml"],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        umask=0o002,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    run = work / "runs" / "demo"
    assert stat.S_IMODE(run.stat().st_mode) == 0o750
    found = modes(run)
    assert {"slurm/job.sbatch", "stages/stage-2.sbatch", "code"} <= set(found)
    assert any(name.endswith("task.py") for name in found), found
    writable = {name: mode for name, mode in found.items() if int(mode, 8) & 0o022}
    assert writable == {}


def test_a_group_writable_run_folder_of_the_user_is_refused_naming_the_fix(tmp_path):
    run = tmp_path / "demo"
    (run / "slurm").mkdir(parents=True)
    rundir.require_safe(run)  # the user's own, private
    (run / "slurm").chmod(0o775)
    with pytest.raises(QgtrainError) as refused:
        rundir.require_safe(run)
    assert str(refused.value) == (
        f"the run directory {run} is not safe to write or run jobs in: {run / 'slurm'} is "
        "writable by its group (owner root, mode 0775); others could change the job files that a "
        f"start or a requeue runs as you. HINT: chmod -R g-w,o-w {run} (once you checked that "
        "no one else changed its files)"
    )
    (run / "slurm").chmod(0o755)
    (run / "slurm" / "job.sbatch").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(QgtrainError, match="is a symbolic link where qgtrain keeps job files"):
        rundir.require_safe(run)
    (run / "slurm" / "job.sbatch").unlink()
    # the user's own links elsewhere are theirs: checkpoints on scratch space, a link in the code
    (run / "checkpoints").symlink_to(tmp_path)
    (run / "code" / "0123" / "submit").mkdir(parents=True)
    (run / "code" / "0123" / "submit" / "data").symlink_to(tmp_path)
    rundir.require_safe(run)


def test_a_log_is_never_appended_to_through_a_planted_link(tmp_path):
    """In a run folder of the user's: the rank's log and metrics.jsonl are opened without
    following a link, and a FIFO is refused rather than waited on."""
    mine = bashrc(tmp_path)
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "run.json").write_text('{"run_id": "earlier"}')  # a run started before
    (run / "logs" / "rank_0.log").symlink_to(mine)
    done = cli("train", "--run-dir", str(run), "--set", *TINY, "train.max_steps=1", cwd=tmp_path)
    assert f"{run / 'logs' / 'rank_0.log'} is a symbolic link where qgtrain appends to a log" in (
        one_error_line(done)
    )
    assert mine.read_text() == ORIGINAL
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(QgtrainError, match="is not a plain file"):
        files.open_append(tmp_path / "fifo")
    with files.open_append(tmp_path / "new.log") as log:
        log.write("a line\n")
    assert stat.S_IMODE((tmp_path / "new.log").stat().st_mode) & 0o022 == 0
