"""The user's files that qgtrain must never lose or overwrite: a folder of their own given as
export.dir or as --run-dir, and whatever file a link planted at one of qgtrain's predictable names
(in a shared data cache or run directory) points at. Runs against: real `qgtrain train` processes
(tests/helpers.cli), real data preparation into a real cache, and real symbolic links."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from qgtrain.config import DataConfig
from qgtrain.data import corpus
from qgtrain.data.cache import prepare
from qgtrain.foundation import files
from qgtrain.foundation.errors import QgtrainError
from tests.helpers import TINY, cli, records

SHORT = [*TINY, "train.eval_every=0"]


def train(run: Path, *sets: str) -> tuple[int, str]:
    done = cli("train", "--run-dir", str(run), "--set", *SHORT, *sets, cwd=run.parent)
    return done.returncode, done.stderr


def one_error_line(err: str) -> str:
    """The refusal: one line, the last, and no traceback before it."""
    assert "Traceback" not in err and err.count("qgtrain: error: ") == 1, err[-3000:]
    return err.splitlines()[-1]


def status(run: Path) -> str:
    return str(json.loads((run / "status.json").read_text())["status"])


def test_an_export_dir_of_other_files_is_left_alone_and_an_earlier_export_replaced(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "notes.txt").write_text("my other models")
    run = tmp_path / "run"
    code, err = train(run, "train.max_steps=2", "export.on_finish=true", f"export.dir={models}")
    assert code == 1, err[-3000:]  # as for an export that fails: training's result is kept
    assert [p.name for p in models.iterdir()] == ["notes.txt"]
    assert (models / "notes.txt").read_text() == "my other models"
    assert status(run) == "finished" and (run / "checkpoints" / "step-2").is_dir()
    log = (run / "logs" / "rank_0.log").read_text()
    assert (
        f"training finished, but nothing was exported: export: {models} holds files that are "
        "not a qgtrain export ('notes.txt')" in log
    )
    assert (
        "export by hand into another folder with "
        f"`qgtrain export {run.resolve()} --out OTHER`" in log
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    for _ in range(2):  # an empty folder is used; a second start finds the run done, exports again
        code, err = train(run, "train.max_steps=2", "export.on_finish=true", f"export.dir={empty}")
        assert code == 0, err[-3000:]
        assert (empty / "qgtrain_model.json").is_file() and not (empty / "stale.txt").exists()
        (empty / "stale.txt").write_text("in the earlier export, so gone when it is replaced")


def test_a_folder_that_is_not_a_run_is_refused_and_left_as_it_was(tmp_path):
    mine = tmp_path / "project"
    mine.mkdir()
    text = "# my settings: lr tuned by hand\ntrain: {max_steps: 5}\n"
    (mine / "config.yaml").write_text(text)
    code, err = train(mine, "train.max_steps=2")
    assert code == 2, err[-3000:]
    assert (
        f"{mine} is not a run directory (it has no run.json) and holds other files "
        "('config.yaml')" in one_error_line(err)
    )
    assert [p.name for p in mine.iterdir()] == ["config.yaml"]
    assert (mine / "config.yaml").read_text() == text
    run = tmp_path / "run"
    assert train(run, "train.max_steps=2")[0] == 0  # a new folder
    assert train(run, "train.max_steps=4")[0] == 0  # the run again: it resumes
    assert [r["step"] for r in records(run) if "loss" in r] == [1, 2, 3, 4]
    submitted = tmp_path / "submitted"  # `qgtrain submit`'s files; a start killed before run.json
    (submitted / "slurm").mkdir(parents=True)
    (submitted / "slurm" / "config.yaml").write_text("train: {max_steps: 2}\n")
    (submitted / ".lock").touch()
    code, err = train(submitted, "train.max_steps=2")
    assert code == 0 and (submitted / "run.json").is_file(), err[-3000:]


def test_a_link_planted_at_the_run_directory_lock_leaves_its_target_alone(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(victim)
    code, err = train(run, "train.max_steps=2")
    assert code == 2, err[-3000:]
    assert f"{run / '.lock'} is a symbolic link where qgtrain keeps a lock file" in one_error_line(
        err
    )
    assert victim.read_text() == "precious"


def test_a_link_planted_at_the_data_cache_lock_or_temporary_folder_leaves_its_target_alone(
    tmp_path,
):
    source = tmp_path / "docs.jsonl"
    source.write_text("".join(json.dumps({"text": f"document {i}"}) + "\n" for i in range(50)))
    data = DataConfig(
        name="files",
        files=(str(source),),
        cache_dir=str(tmp_path / "cache"),
        val_fraction=0.1,
        test_fraction=0.1,
    )
    entry = prepare.plan(data).folder
    entry.parent.mkdir(parents=True)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    lock = entry.with_name(f"{entry.name}.lock")  # named by the data files' path, size and time
    lock.symlink_to(victim)
    with pytest.raises(QgtrainError, match="is a symbolic link where qgtrain keeps a lock file"):
        prepare.prepare(data, 1)
    assert victim.read_text() == "precious" and not entry.exists()
    lock.unlink()
    leftover = entry.with_name(f"{entry.name}.tmp-node3-1234")  # a job killed while tokenizing
    leftover.mkdir()
    (leftover / "train.bin").write_bytes(b"half")
    victims = tmp_path / "victims"
    victims.mkdir()
    (victims / "thesis.tex").write_text("precious")
    planted = entry.with_name(f"{entry.name}.tmp-planted")
    planted.symlink_to(victims, target_is_directory=True)
    tokens, made = prepare.prepare(data, 1)
    assert made and tokens.tokens["train"] > 0
    assert not leftover.exists() and not planted.is_symlink()
    assert [p.name for p in victims.iterdir()] == ["thesis.tex"]
    assert victim.read_text() == "precious" and lock.is_file() and not lock.is_symlink()


def test_a_link_planted_at_the_corpus_temporary_folder_leaves_its_target_alone(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("the corpus of this test, a few words long\n" * 50)
    data = DataConfig(corpus=str(text), cache_dir=str(tmp_path / "cache"))
    entry = corpus.prepare(data).folder
    for path in sorted(entry.iterdir()):
        path.unlink()
    entry.rmdir()
    victims = tmp_path / "victims"
    victims.mkdir()
    (victims / "thesis.tex").write_text("precious")
    entry.with_name(f"{entry.name}.tmp-{os.getpid()}").symlink_to(victims, target_is_directory=True)
    assert corpus.prepare(data).folder == entry
    assert (entry / "train.bin").is_file() and not entry.is_symlink()
    assert [p.name for p in victims.iterdir()] == ["thesis.tex"]


def test_an_atomic_write_never_writes_through_a_link_at_a_temporary_name(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / f"status.json.tmp-{os.getpid()}").symlink_to(victim)  # the name it wrote through
    files.write_atomic(tmp_path / "status.json", '{"status": "running"}')
    assert victim.read_text() == "precious"
    assert (tmp_path / "status.json").read_text() == '{"status": "running"}'
    assert not (tmp_path / "status.json").is_symlink()
    assert [p.name for p in tmp_path.glob("status.json.tmp-*") if not p.is_symlink()] == []
