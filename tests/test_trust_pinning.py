"""A run folder is worked in only while it is the folder that was checked: a runs folder anyone can
write without the sticky bit is refused (a group-writable one warned about), a run folder renamed
and replaced while the run trains stops the run before anything is written into the replacement,
compile-cache/ and submitit/ hold code and are checked as code/ is, and a compile cache made in
another folder (a copied run) is removed unread. Runs against: real `qgtrain train` processes
(tests/helpers.cli, tests/ranks.start_cli_ranks), folders renamed by the real user `nobody`
(through runuser, as root), real `cp -r` copies, and inductor's own cache switch (nothing is
compiled)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from qgtrain.foundation.errors import QgtrainError
from qgtrain.foundation.pinned import FolderReplaced, Pinned
from qgtrain.launch import codesnap, runfrom
from qgtrain.runs import rundir
from qgtrain.runtime import compile_cache
from tests.helpers import TINY, cli, one_error_line, wait_for
from tests.ranks import start_cli_ranks, wait_ranks

NOBODY = 65534
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="acting as another user (nobody) needs root"
)


@pytest.fixture
def runs() -> Iterator[Path]:
    """A runs folder outside pytest's tmp_path (which only root can enter), for `nobody` to reach
    and for the modes the tests give it."""
    folder = Path(tempfile.mkdtemp(prefix="qgtrain-runs-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def as_nobody(script: str) -> None:
    subprocess.run(["runuser", "-u", "nobody", "--", "sh", "-c", script], check=True)


def listing(folder: Path) -> dict[str, bytes | None]:
    """Everything below `folder`, with the contents of its files."""
    return {
        str(p.relative_to(folder)): p.read_bytes() if p.is_file() else None
        for p in sorted(folder.rglob("*"))
    }


def test_a_runs_folder_anyone_can_write_without_the_sticky_bit_is_refused(runs, tmp_path):
    runs.chmod(0o777)
    done = cli("train", "--run-dir", str(runs / "demo"), "--set", *TINY, cwd=tmp_path)
    line = one_error_line(done)
    assert f"{runs} (mode 0777), above {runs / 'demo'}, can be written by every user" in line
    assert f"HINT: chmod +t {runs} (then only an entry's owner may rename it), or chmod o-w" in line
    assert list(runs.iterdir()) == [], "nothing written"
    runs.chmod(0o1777)  # sticky, as /tmp: only an entry's owner may rename it
    rundir.require_safe(runs / "demo")


def test_a_group_writable_runs_folder_is_used_with_one_warning(runs, tmp_path):
    runs.chmod(0o2775)  # a group project folder under umask 002
    sets = [*TINY, "train.max_steps=1"]
    done = cli("train", "--run-dir", str(runs / "demo"), "--set", *sets, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "is writable by its group" in line]
    assert len(said) == 1, done.stderr[-3000:]
    assert f"{runs} (mode 2775) is writable by its group, above {runs / 'demo'}" in said[0]
    assert f"HINT: chmod +t {runs}" in said[0]
    warned: list[str] = []
    assert rundir.require_safe(runs / "demo", warned.append) == Pinned.now(runs / "demo")
    assert len(warned) == 1


def test_the_folder_holding_a_link_to_the_run_folder_is_judged_too(runs, tmp_path):
    """A run folder of the user's on scratch space, reached through their link in a folder anyone
    can write: whoever writes that folder can point the link elsewhere."""
    scratch = tmp_path / "scratch-demo"
    scratch.mkdir()
    (runs / "demo").symlink_to(scratch)
    runs.chmod(0o777)
    with pytest.raises(QgtrainError, match=f"{runs} \\(mode 0777\\), above {runs / 'demo'}"):
        rundir.require_safe(runs / "demo")
    runs.chmod(0o1777)
    pin = rundir.require_safe(runs / "demo")  # the folder the user's link leads to
    now = Pinned.now(scratch)
    assert pin is not None and (pin.device, pin.inode) == (now.device, now.inode)


@needs_root
@pytest.mark.parametrize("async_save", ["false", "true"])
def test_a_run_folder_replaced_while_training_stops_the_run_writing_nothing_there(runs, async_save):
    """A colleague who can write the group's runs folder renames the run folder after its first
    checkpoint and moves a prepared one in: the next save stops the run in one line, and the
    prepared folder holds only what the colleague put there."""
    shutil.chown(runs, group="nogroup")
    runs.chmod(0o2775)
    run = runs / "demo"
    sets = [*TINY, "train.max_steps=100000", "checkpoint.every_steps=5"]
    args = ["train", "--run-dir", str(run), "--set", *sets, f"checkpoint.async_save={async_save}"]
    ranks = start_cli_ranks(1, args, runs)
    wait_for(lambda: (run / "checkpoints" / "step-5" / "manifest.json").exists(), ranks, "step 5")
    as_nobody(
        f"mv {run} {runs}/renamed && mkdir -p {run}/checkpoints {run}/compile-cache/rank-0 && "
        f'echo \'{{"run_id": "x"}}\' > {run}/run.json && '
        f'echo \'open("/tmp/pwned", "w")\' > {run}/compile-cache/rank-0/kernel.py'
    )
    prepared = listing(run)
    assert wait_ranks(ranks, 120) == [2]
    out = (runs / "rank-0.out").read_text()
    assert out.count("qgtrain: error: ") == 1 and "Traceback" not in out, out[-3000:]
    assert out.splitlines()[-1].startswith(
        f"qgtrain: error: {run} is no longer the folder checked at start (it was replaced): "
        "stopping without writing"
    ), out[-3000:]
    assert listing(run) == prepared, "nothing written into the replacement"
    assert (runs / "renamed" / "checkpoints" / "step-5").is_dir(), "the run's own, renamed"


@needs_root
@pytest.mark.parametrize(
    "planted",
    ["compile-cache/rank-0", "submitit/x_submitted.pkl"],
)
def test_a_compile_cache_or_submitit_pickle_of_another_user_is_refused(tmp_path, planted):
    run = tmp_path / "demo"
    (run / "compile-cache").mkdir(parents=True)
    (run / "submitit").mkdir()
    (run / "run.json").write_text('{"run_id": "mine"}')
    entry = run / planted
    if planted.endswith(".pkl"):
        entry.write_bytes(b"cposix\nsystem\n(S'touch /tmp/pwned'\ntR.")
        entry.chmod(0o666)
    else:
        entry.mkdir()
        (entry / "kernel.py").write_text("open('/tmp/pwned', 'w')\n")
        entry.chmod(0o777)
    os.chown(entry, NOBODY, NOBODY)
    before = listing(run)
    sets = [*TINY, "train.max_steps=1", "model.compile=true"]
    done = cli("train", "--run-dir", str(run), "--set", *sets, cwd=tmp_path)
    line = one_error_line(done)
    assert f"{entry} belongs to uid 65534, not to you (uid 0)" in line
    assert f"(owner nobody, mode {'0666' if planted.endswith('.pkl') else '0777'})" in line
    assert listing(run) == before, "nothing written"
    # a submitit job's script checks its run folder (submitit/ included) before submitit unpickles
    code = codesnap.take(tmp_path, run / "code", 50, leave_out=(run,))
    with pytest.raises(QgtrainError, match="belongs to uid 65534"):
        runfrom.verified(code.folder)


def test_links_out_of_compile_cache_and_submitit_are_refused_links_inside_are_not(tmp_path):
    run = tmp_path / "demo"
    (run / "compile-cache" / "rank-0").mkdir(parents=True)
    (run / "submitit").mkdir()
    (run / "submitit" / "1_submission.sh").write_text("#!/bin/sh\n")
    (run / "submitit" / ".submission_file_ab.sh").symlink_to(run / "submitit" / "1_submission.sh")
    rundir.require_safe(run)  # submitit's own link, inside its folder
    (run / "compile-cache" / "rank-0" / "kernel.py").symlink_to(tmp_path / "elsewhere.py")
    with pytest.raises(QgtrainError, match="is a symbolic link leading out of .*compile-cache"):
        rundir.require_safe(run)


def cache_of(run: Path, run_id: str, payload: Path) -> Path:
    """A run folder whose rank 0 compile cache was made there, holding generated code that would
    write `payload` if it ever ran."""
    (run / "compile-cache" / "rank-0").mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": run_id}))
    (run / "compile-cache" / "rank-0" / "kernel.py").write_text(f"open({str(payload)!r}, 'w')\n")
    record = compile_cache.record(Pinned.now(run), run_id)
    (run / "compile-cache" / "rank-0.json").write_text(json.dumps(record))
    return run / "compile-cache" / "rank-0"


def test_a_copied_runs_compile_cache_is_removed_unread_and_started_afresh(tmp_path, caplog):
    payload = tmp_path / "payload-ran"
    theirs = cache_of(tmp_path / "theirs", "r1", payload)
    mine = tmp_path / "mine"
    subprocess.run(["cp", "-r", str(tmp_path / "theirs"), str(mine)], check=True)
    with caplog.at_level(logging.WARNING, logger="qgtrain"):
        with compile_cache.in_run_dir(mine, 0, Pinned.now(mine), "r1") as folder:
            assert "kernel.py" in os.listdir(folder)  # offered, not yet claimed: still there
            assert compile_cache.claim() == folder
            assert os.listdir(folder) == [], "a fresh cache"
    said = [r.getMessage() for r in caplog.records if "compile cache" in r.getMessage()]
    assert said == [
        f"the compile cache {folder} was made in another folder than this run's (a copied run, "
        "or a folder put in place of this one): removed it unread; compiling afresh"
    ]
    assert not payload.exists()
    assert not [p for p in (mine / "compile-cache").iterdir() if ".tmp-" in p.name]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="qgtrain"):  # the original keeps its own cache
        with compile_cache.in_run_dir(theirs.parents[1], 0, Pinned.now(theirs.parents[1]), "r1"):
            compile_cache.claim()
    assert caplog.records == [] and (theirs / "kernel.py").exists()


def test_a_compile_cache_without_a_record_or_of_another_run_is_removed(tmp_path, caplog):
    run = tmp_path / "run"
    cache = cache_of(run, "r1", tmp_path / "payload")
    with caplog.at_level(logging.WARNING, logger="qgtrain"):
        compile_cache.bind(cache, compile_cache.record(Pinned.now(run), "r2"))
    assert "was made for run 'r1', not 'r2'" in caplog.text and not cache.exists()
    cache.mkdir()
    (cache / "kernel.py").write_text("")
    cache.with_name("rank-0.json").unlink()
    compile_cache.bind(cache, compile_cache.record(Pinned.now(run), "r2"))
    assert "has no record of the run folder it was made in" in caplog.text and not cache.exists()


def test_a_compile_cache_is_never_claimed_once_the_run_folder_was_replaced(tmp_path):
    run = tmp_path / "run"
    cache_of(run, "r1", tmp_path / "payload")
    before = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    with compile_cache.in_run_dir(run, 0, Pinned.now(run), "r1"):
        run.rename(tmp_path / "moved")
        cache_of(run, "r1", tmp_path / "payload")  # a look-alike, with a record of its own
        with pytest.raises(FolderReplaced, match="is no longer the folder checked at start"):
            compile_cache.claim()
        now = {k: os.environ.get(k) for k in before}
        assert now == before, "inductor was never pointed at it"
