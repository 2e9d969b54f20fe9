"""`qgtrain eval` on a run or export that is not yours writes nothing through it and reads none of
the task files its config names: results and samples go to a folder of yours, scored on your own
eval.tasks; on your own run, an eval/ (or a results or samples file) that is a link is refused in
one line before anything is written. Runs against: real `qgtrain train` and `qgtrain eval`
processes, run folders owned by another real user (`nobody`, through runuser, as root) with links
they made, and a task file only root can read."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.helpers import cli, one_error_line, train_command

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="acting as another user (nobody) needs root"
)
STEP = 2
SAY = "say"  # the user's own task, a generate one: it writes samples
TASKS = [
    "--set",
    "eval.tasks=[{name: say, kind: generate, files: [say.jsonl]}]",
    "eval.max_new_tokens=4",
]
USERS_SAMPLES = '{"task": "say", "index": 0, "output": "the user\'s own sample"}\n'
USERS_RESULTS = '{"step": 2, "checkpoint": "step-2", "task": "say", "scored_as": "x"}\n'


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the user's working folder, holding say.jsonl, and a run of 2 steps: one checkpoint)."""
    folder = tmp_path_factory.mktemp("trust-eval")
    docs = [{"text": f"doc {i}: anna likes red, bert likes blue."} for i in range(300)]
    (folder / "train.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    asked = [{"prompt": f"{name} likes", "answer": " red"} for name in ("anna", "bert")]
    (folder / "say.jsonl").write_text("".join(json.dumps(a) + "\n" for a in asked))
    run = folder / "run"
    done = cli(
        *train_command(
            run,
            "data.name=files",
            "data.files=['train.jsonl']",
            "data.seq_len=16",
            f"data.cache_dir={folder / 'cache'}",
            "model.hidden=32",
            "model.layers=1",
            "model.heads=2",
            f"train.max_steps={STEP}",
            "train.batch_size=4",
            f"checkpoint.every_steps={STEP}",
            "logging.tensorboard=false",
        ),
        cwd=folder,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return folder, run


@pytest.fixture
def shared() -> Iterator[Path]:
    """A group project folder (pytest's tmp_path sits under a folder nobody cannot enter)."""
    folder = Path(tempfile.mkdtemp(prefix="qgtrain-shared-", dir="/tmp"))
    folder.chmod(0o755)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def colleagues(run: Path, where: Path, tasks: list[dict] | None = None) -> Path:
    """A copy of `run` that belongs to nobody, without an eval/, its config naming `tasks`."""
    shutil.copytree(run, where, symlinks=True)
    shutil.rmtree(where / "eval", ignore_errors=True)
    if tasks is not None:
        config = yaml.safe_load((where / "config.yaml").read_text())
        config["eval"]["tasks"] = tasks
        (where / "config.yaml").write_text(yaml.safe_dump(config))
    subprocess.run(["chown", "-R", "nobody:nogroup", str(where)], check=True)
    return where


def as_nobody(*command: str) -> None:
    made = subprocess.run(["runuser", "-u", "nobody", "--", *command], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"runuser -u nobody failed: {made.stderr.decode().strip()}")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def everything(folder: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@needs_root
def test_eval_of_a_colleagues_run_never_writes_through_their_eval_link(trained, shared):
    folder, run = trained
    mine = folder / "mine"
    shutil.copytree(run, mine, symlinks=True)
    (mine / "eval").mkdir(mode=0o700, exist_ok=True)
    (mine / "eval" / f"step-{STEP}.jsonl").write_text(USERS_SAMPLES)
    (mine / "eval" / "results.jsonl").write_text(USERS_RESULTS)
    theirs = colleagues(run, shared / "theirs")
    as_nobody("ln", "-s", str(mine / "eval"), str(theirs / "eval"))
    before = sorted(p.name for p in theirs.iterdir())

    done = cli("eval", str(theirs), *TASKS, cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"eval: {theirs} is not yours ({theirs} belongs to uid 65534" in done.stderr
    out = folder / "runs" / "eval-of-theirs"
    assert "results go to runs/eval-of-theirs" in done.stderr
    assert (mine / "eval" / f"step-{STEP}.jsonl").read_text() == USERS_SAMPLES
    assert (mine / "eval" / "results.jsonl").read_text() == USERS_RESULTS
    assert sorted(p.name for p in theirs.iterdir()) == before
    scored = lines(out / "results.jsonl")
    assert [(r["step"], r["task"], r["source"]) for r in scored] == [(STEP, SAY, str(theirs))]
    assert [s["task"] for s in lines(out / f"step-{STEP}.jsonl")] == [SAY, SAY]
    assert (out.stat().st_mode & 0o777) == 0o700

    again = cli("eval", str(theirs), *TASKS, cwd=folder)  # "already scored": read from out
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"step {STEP} already scored on every task" in again.stderr
    assert lines(out / "results.jsonl") == scored

    chosen = folder / "chosen"
    given = cli("eval", str(theirs), *TASKS, "--out", str(chosen), cwd=folder)
    assert given.returncode == 0, given.stderr[-3000:]
    assert [r["task"] for r in lines(chosen / "results.jsonl")] == [SAY]
    assert (mine / "eval" / "results.jsonl").read_text() == USERS_RESULTS
    assert lines(out / "results.jsonl") == scored


@needs_root
def test_a_colleagues_run_is_scored_on_your_tasks_never_on_the_files_its_config_names(
    trained, shared
):
    folder, run = trained
    secret = folder / "secret.jsonl"  # a file only root (the user) can read
    secret.write_text('{"prompt": "SECRET-PROMPT", "answer": "SECRET-ANSWER"}\n')
    secret.chmod(0o600)
    named = [{"name": "hushhush", "kind": "generate", "files": [str(secret)]}]
    theirs = colleagues(run, shared / "theirs", named)

    none_given = cli("eval", str(theirs), cwd=folder)
    line = one_error_line(none_given)
    assert f"eval: no eval.tasks to score on {theirs} (not yours, so its own config" in line
    assert "hushhush" not in none_given.stdout + none_given.stderr

    out = folder / "out"
    done = cli("eval", str(theirs), *TASKS, "--out", str(out), cwd=folder)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hushhush" not in done.stdout + done.stderr
    assert "the 1 eval.tasks of its config are ignored, yours are scored" in done.stderr
    assert {r["task"] for r in lines(out / "results.jsonl")} == {SAY}
    assert not (theirs / "eval").exists()
    for path, content in everything(theirs).items():
        assert b"SECRET-" not in content, path
    for path, content in everything(out).items():
        assert b"SECRET-" not in content and b"hushhush" not in content, path


@pytest.mark.parametrize("link", ["eval", "eval/results.jsonl", f"eval/step-{STEP}.jsonl"])
def test_a_link_in_your_own_runs_eval_is_refused_and_nothing_is_written(trained, tmp_path, link):
    folder, run = trained
    mine = tmp_path / "mine"
    shutil.copytree(run, mine, symlinks=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "kept.jsonl").write_text(USERS_RESULTS)
    if link == "eval":
        (mine / "eval").symlink_to(elsewhere)
    else:
        (mine / "eval").mkdir(exist_ok=True)
        (mine / link).symlink_to(elsewhere / "kept.jsonl")
    before = everything(mine)

    line = one_error_line(cli("eval", str(mine), *TASKS, cwd=folder))
    assert f"eval: {mine / link} is a symbolic link, where qgtrain writes evaluation" in line
    assert f"HINT: remove the link ({mine / link}), or pass --out DIR" in line
    assert everything(elsewhere) == {str(elsewhere / "kept.jsonl"): USERS_RESULTS.encode()}
    assert everything(mine) == before
