"""The code snapshot as a colleague sees it (issue 44): secret-like files never reach it, it is
read-only and the user's alone, a snapshot changed after submit (an edited file, a swapped folder)
is refused at the next start, and a planted job record naming code elsewhere is refused; in each
case one line, exit 2, and the planted code never runs (it would write a marker file). Runs against
real folders and git repositories, `qgtrain submit` with a stand-in sbatch, and the job's own shell
lines run by bash; another user is `nobody` via runuser (as root only)."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from qgtrain.launch import codesnap, snapseal
from qgtrain.launch.runfrom import recorded
from qgtrain.launch.sbatch import FIRST_START_SNAPSHOT
from tests.helpers import cli, stand_in_sbatch

ROOT = Path(__file__).resolve().parents[1]
KEY_BLOCK = "-----BEGIN OPENSSH " + "PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAA\n-----END"
# name -> content: each looks like a credential by its name, or holds a private key
SECRETS = {
    ".env": "HF_TOKEN=hf_abc\n",
    ".env.local": "WANDB_API_KEY=abc\n",
    "deploy_key": "ssh key\n",
    "server.pem": "cert\n",
    "tls.key": "key\n",
    "id_ed25519": "key\n",
    "aws_credentials.json": "{}\n",
    "client_secret.json": "{}\n",
    ".secrets.toml": "token = 'abc'\n",
    "gcp-service-account.json": "{}\n",
    ".netrc": "machine h login u password p\n",
    ".pypirc": "[pypi]\npassword = p\n",
    "conf/keys.yaml": f"key: |\n  {KEY_BLOCK}\n",
    "private_notes.yaml": "x: 1\n",  # slurm.snapshot_exclude's
}


def marker_code(marker: Path) -> str:
    """Python that, if it ever runs, leaves `marker` behind."""
    return f"import pathlib; pathlib.Path({str(marker)!r}).write_text('planted code ran')\n"


def project(root: Path, git: bool) -> Path:
    folder = root / "project"
    folder.mkdir()
    (folder / "my_task.py").write_text("VALUE = 1\n")
    (folder / "config.yaml").write_text("train: {run_name: demo}\nlogging: {runs_dir: runs}\n")
    for name, text in SECRETS.items():
        (folder / name).parent.mkdir(exist_ok=True)
        (folder / name).write_text(text)
    (folder / "deploy_key").chmod(0o644)
    if git:
        (folder / ".gitignore").write_text("runs/\njobs/\n")
        subprocess.run(["git", "init", "-q"], cwd=folder, check=True)
    return folder


def modes(folder: Path) -> set[int]:
    return {
        stat.S_IMODE(p.lstat().st_mode) for p in [folder, *folder.rglob("*")] if not p.is_symlink()
    }


def snapshot_of(folder: Path) -> Path:
    (code,) = [p for p in (folder / "runs" / "demo" / "code").iterdir() if p.name != "jobs"]
    return code


@pytest.mark.parametrize("git", [True, False], ids=["git", "plain"])
def test_secret_files_are_left_out_named_at_submit_and_the_copy_is_owner_only(tmp_path, git):
    folder = project(tmp_path, git)
    (folder / "run.sh").write_text("#!/bin/sh\n")
    (folder / "run.sh").chmod(0o775)
    (folder / "credentials.py").write_text("TOKEN_VARIABLE = 'HF_TOKEN'\n")  # code, kept
    old = os.umask(0o002)  # a group project's umask: it must not make the copy group-writable
    try:
        done = cli(
            "submit",
            "--config",
            "config.yaml",
            "--set",
            "slurm.snapshot_exclude=[private_*]",
            cwd=folder,
            env=stand_in_sbatch(tmp_path),
        )
    finally:
        os.umask(old)
    assert done.returncode == 0, done.stderr
    code = snapshot_of(folder)
    copied = {p.relative_to(code / "submit").as_posix() for p in (code / "submit").rglob("*")}
    assert not copied & set(SECRETS), copied
    assert {"my_task.py", "config.yaml", "run.sh", "credentials.py"} <= copied
    candidates = [n for n in SECRETS if git or n.endswith((".json", ".toml", ".yaml"))]
    said = [line for line in done.stderr.splitlines() if "leaves out" in line]
    assert len(said) == 1 and all(name in said[0] for name in candidates), done.stderr
    assert modes(code) == {0o400, 0o500}, "read-only, the owner's alone"
    assert stat.S_IMODE((code / "submit" / "run.sh").stat().st_mode) == 0o500
    assert stat.S_IMODE(code.parent.stat().st_mode) == 0o700
    before = codesnap.digest(codesnap.collect(folder, (folder / "runs",)))
    (folder / ".env").write_text("HF_TOKEN=hf_other\n")
    (folder / "conf" / "keys.yaml").write_text(f"other: |\n  {KEY_BLOCK}\n")
    assert codesnap.digest(codesnap.collect(folder, (folder / "runs",))) == before, "not hashed"


def test_a_shared_run_gets_a_group_readable_never_group_writable_copy_that_cleanup_removes(
    tmp_path,
):
    folder = project(tmp_path, git=False)
    old = os.umask(0o002)
    try:
        code = codesnap.take(folder, tmp_path / "run" / "code", 50, shared=True)
    finally:
        os.umask(old)
    assert modes(code.folder) == {0o440, 0o550}
    assert stat.S_IMODE(code.folder.parent.stat().st_mode) == 0o750
    snapseal.verify(code.folder)
    snapseal.remove(code.folder)
    assert not code.folder.exists()


def test_a_snapshot_changed_in_place_is_never_reused_by_the_next_submit(tmp_path):
    folder = project(tmp_path, git=False)
    code = codesnap.take(folder, tmp_path / "run" / "code", 50)
    (code.workdir / "my_task.py").chmod(0o600)
    (code.workdir / "my_task.py").write_text("VALUE = 'theirs'\n")
    with pytest.raises(snapseal.SnapshotChanged, match="holds files that hash to .*remove it"):
        codesnap.take(folder, tmp_path / "run" / "code", 50)


def job_lines(script: Path) -> str:
    """The lines of a submitted job's script that check its snapshot and move into it."""
    lines = script.read_text().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("verify_python="))
    last = next(i for i, line in enumerate(lines) if line.startswith("export PYTHONPATH="))
    return "\n".join(lines[first : last + 1])


def run_job(
    folder: Path, moves: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`moves` as the batch shell runs them, then Python importing qgtrain and the task module from
    wherever they moved it (planted code there writes the marker)."""
    script = (
        f"set -u\nRECOVER_PYTHON={sys.executable}\nargs=(--config config.yaml)\n{moves}\n"
        '"$RECOVER_PYTHON" -c "import qgtrain, my_task"\n'
    )
    return subprocess.run(
        ["bash", "-c", script],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
    )


def refused(done: subprocess.CompletedProcess[str], said: str) -> None:
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and said in done.stderr, done.stderr


def test_a_submitted_job_refuses_a_snapshot_edited_after_submit_and_runs_nothing(tmp_path):
    folder = project(tmp_path, git=False)
    done = cli("submit", "--config", "config.yaml", cwd=folder, env=stand_in_sbatch(tmp_path))
    assert done.returncode == 0, done.stderr
    moves = job_lines(folder / "runs" / "demo" / "slurm" / "job.sbatch")
    assert run_job(folder, moves).returncode == 0, "unchanged, it runs"
    marker = tmp_path / "marker"
    (snapshot_of(folder) / "submit" / "my_task.py").write_text(marker_code(marker))
    done = run_job(folder, moves)
    refused(done, "not to its name: they changed")
    assert f"{snapshot_of(folder)} holds files that hash to" in done.stderr
    assert not marker.exists()


def test_train_slurm_refuses_at_the_requeue_a_snapshot_edited_after_the_first_start(tmp_path):
    folder = project(tmp_path, git=False)
    first = run_job(folder, FIRST_START_SNAPSHOT, {"SLURM_JOB_ID": "41"})
    assert first.returncode == 0, first.stderr
    record = folder / "runs" / "demo" / "code" / "jobs" / "41.json"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    marker = tmp_path / "marker"
    (snapshot_of(folder) / "submit" / "my_task.py").write_text(marker_code(marker))
    requeued = run_job(folder, FIRST_START_SNAPSHOT, {"SLURM_JOB_ID": "41"})
    refused(requeued, "holds files that hash to")
    assert not marker.exists()


def planted_code(root: Path, marker: Path) -> Path:
    """A colleague's 'snapshot': their qgtrain and task module, and a config."""
    evil = root / "evil" / "0123456789abcdef"
    (evil / "lib" / "qgtrain").mkdir(parents=True)
    (evil / "submit").mkdir()
    (evil / "lib" / "qgtrain" / "__init__.py").write_text(marker_code(marker))
    (evil / "submit" / "my_task.py").write_text(marker_code(marker))
    (evil / "config.yaml").write_text("train: {run_name: demo}\n")
    return evil


def test_a_planted_job_record_naming_code_elsewhere_is_refused_and_its_code_never_runs(tmp_path):
    folder = project(tmp_path, git=False)
    marker = tmp_path / "marker"
    evil = planted_code(tmp_path, marker)
    jobs = folder / "runs" / "demo" / "code" / "jobs"
    jobs.mkdir(parents=True, mode=0o700)
    (jobs / "41.json").write_text(
        json.dumps({"code": str(evil), "hash": evil.name, "config": str(evil / "config.yaml")})
    )
    done = run_job(folder, FIRST_START_SNAPSHOT, {"SLURM_JOB_ID": "41"})
    refused(done, f"names {evil}, not a snapshot of this run")
    assert not marker.exists()


@pytest.mark.parametrize("plant", ["link", "config", "hash", "garbage", "copy"])
def test_a_job_record_counts_only_for_this_runs_own_verified_snapshot(tmp_path, plant):
    folder = project(tmp_path, git=False)
    code_dir = tmp_path / "run" / "code"
    code = codesnap.take(folder, code_dir, 50)
    evil = planted_code(tmp_path, tmp_path / "marker")
    jobs = code_dir / "jobs"
    jobs.mkdir(mode=0o700)
    (jobs / "7.yaml").write_text("train: {run_name: demo}\n")
    named, config, name = code.folder, jobs / "7.yaml", code.digest
    if plant == "link":  # code/<hash> itself a link to the colleague's folder
        named = code_dir / evil.name
        named.symlink_to(evil)
        name = evil.name
    elif plant == "config":
        config = evil / "config.yaml"
    elif plant == "hash":
        name = "0" * 16
    elif plant == "copy":  # this run's name, but not the files it was made from
        named = code_dir / evil.name
        shutil.copytree(evil, named)
        name = evil.name
    record = {"code": str(named), "hash": name, "config": str(config)}
    (jobs / "7.json").write_text("{" if plant == "garbage" else json.dumps(record))
    with pytest.raises(snapseal.SnapshotChanged, match=r"the (job record|code snapshot) "):
        recorded(jobs / "7.json", code_dir)
    (jobs / "7.json").write_text(
        json.dumps(
            {
                **record,
                "code": str(code.folder),
                "hash": code.digest,
                "config": str(jobs / "7.yaml"),
            }
        )
    )
    assert recorded(jobs / "7.json", code_dir) == (code, jobs / "7.yaml")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as the user nobody")
def test_a_snapshot_swapped_by_another_user_is_refused_and_their_code_never_runs():
    shared_root = Path(tempfile.mkdtemp(prefix="qgtrain-snap-"))
    try:
        shared_root.chmod(0o1777)  # sticky, as /tmp: no one renames what others made there
        folder = project(shared_root, git=False)
        env = stand_in_sbatch(shared_root)
        submitted = cli(
            "submit", "--config", "config.yaml", "--set", "logging.shared=true", cwd=folder, env=env
        )
        assert submitted.returncode == 0, submitted.stderr
        code = snapshot_of(folder)
        for loose in (folder / "runs", folder / "runs" / "demo", code.parent):
            loose.chmod(0o777)  # folders an older qgtrain or a loose umask left open
        marker = shared_root / "marker"
        swap = (
            f"mv {code} {code}.gone && mkdir -p {code}/submit {code}/lib && "
            f"printf %s {shlex.quote(marker_code(marker))} > {code}/submit/my_task.py"
        )
        subprocess.run(["runuser", "-u", "nobody", "--", "bash", "-c", swap], check=True)
        moves = job_lines(folder / "runs" / "demo" / "slurm" / "job.sbatch")
        done = run_job(folder, moves)
        # the job's check of its run folder comes first: anyone could replace what runs/ holds
        refused(done, f"{folder / 'runs'} (mode 0777), above {folder / 'runs' / 'demo'}, can be")
        assert not marker.exists()
    finally:
        snapseal.remove(shared_root)
