"""Code an artifact names runs only when it is built in, the run is the user's own, or the user says
so. Runs against: real runs trained by the CLI, `qgtrain export` in a child process, load_model in
this one, and a task file that leaves a mark when it is imported (the witness that its code ran)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from pathlib import Path

import pytest

from qgtrain.config.load import load_config
from qgtrain.foundation.errors import CheckpointError, QgtrainError
from qgtrain.foundation.task import BUILTIN_LM
from qgtrain.foundation.trust import Named, config_code
from tests.helpers import cli, train_command

TASK_FILE = """from pathlib import Path

Path(__file__).with_name("imported").write_text("ran")

from tests.tasks import points


def build(cfg):
    return points(cfg)
"""


def train(tmp_path: Path, run: Path, *sets: str) -> tuple[str, Path]:
    """A two-step run of a task in a file of tmp_path: its spec, and the mark its import leaves
    (removed here, once training has made it)."""
    (tmp_path / "evil.py").write_text(TASK_FILE)
    spec = f"{tmp_path / 'evil.py'}:build"
    done = cli(
        *train_command(
            run,
            f"task={spec}",
            "train.batch_size=8",
            "train.max_steps=2",
            "train.eval_every=0",
            "logging.tensorboard=false",
            *sets,
        ),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    (tmp_path / "imported").unlink()
    return spec, tmp_path / "imported"


@pytest.mark.slow
def test_a_run_others_can_write_exports_its_task_file_only_with_trust_code(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    spec, imported = train(tmp_path, run, "export.on_finish=true")
    assert (run / "export" / "qgtrain_model.json").is_file()
    os.chmod(run, 0o777)  # opened to everyone after training (a run is never trained in one)
    config = run / "checkpoints" / "step-2" / "config.yaml"
    out = tmp_path / "out"

    def refused(why: str) -> None:
        done = cli("export", str(run), "--out", str(out), cwd=tmp_path)
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert f"export: task.factory {spec!r} in {config} is code outside qgtrain" in done.stderr
        assert why in done.stderr and "pass --trust-code" in done.stderr
        assert not imported.exists() and not out.exists()

    refused(f"{run} is writable by its group and others")
    os.chmod(run, 0o755)
    os.chmod(config, 0o664)
    refused(f"{config} is writable by its group")
    os.chmod(config, 0o644)
    os.chown(run, 4242, -1)
    refused(f"{run} belongs to uid 4242, not to you")
    os.chown(run, os.getuid(), -1)
    shutil.move(config, tmp_path / "config.yaml")
    config.symlink_to(tmp_path / "config.yaml")
    # a checkpoint never holds a link: verification refuses it before its code is considered
    linked = cli("export", str(run), "--out", str(out), cwd=tmp_path)
    assert linked.returncode == 2 and f"{config} is a symbolic link" in linked.stderr, linked.stderr
    assert not imported.exists() and not out.exists()
    config.unlink()
    shutil.move(tmp_path / "config.yaml", config)

    done = cli("export", str(run), "--out", str(out), "--trust-code", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert imported.exists() and (out / "qgtrain_model.json").is_file()


@pytest.mark.slow
def test_your_own_run_exports_without_the_flag_but_its_export_loads_only_with_trust_code(tmp_path):
    import qgtrain

    spec, imported = train(tmp_path, tmp_path / "run")
    assert not os.stat(tmp_path / "run").st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    done = cli("export", str(tmp_path / "run"), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    # the export carries its own copy of the task file (export/bundle.py), named relative to it,
    # which the export's check of the reloaded folder imported
    carried = tmp_path / "out" / "code" / "imported"
    assert imported.exists() and carried.exists()
    imported.unlink()
    carried.unlink()

    with pytest.raises(QgtrainError) as refused:  # folders are passed around: owners prove nothing
        qgtrain.load_model(tmp_path / "out")
    said, meta = str(refused.value), tmp_path / "out" / "qgtrain_model.json"
    named = "code/evil.py:build"
    assert f"load_model: task.factory {named!r} in {meta} is code outside qgtrain" in said
    assert "pass trust_code=True" in said and not carried.exists() and not imported.exists()
    model = qgtrain.load_model(tmp_path / "out", trust_code=True)
    assert type(model).__name__ == "Sequential" and carried.exists()


WITNESS = """from pathlib import Path

import torch

Path(__file__).with_name("imported").write_text("ran")


class Model:
    @classmethod
    def from_pretrained(cls, folder):
        return torch.nn.Linear(2, 2)
"""


def test_load_model_imports_a_class_by_name_only_from_transformers_or_when_trusted(
    tmp_path, monkeypatch
):
    import qgtrain

    name = f"witness_{os.getpid()}_{tmp_path.name.replace('-', '_')}"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / f"{name}.py").write_text(WITNESS)
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    monkeypatch.delitem(sys.modules, name, raising=False)
    folder = tmp_path / "folder"  # as a clone of someone's repository would hold it
    folder.mkdir()
    meta = {"format": 1, "kind": "hub", "class": f"{name}.Model"}
    (folder / "qgtrain_model.json").write_text(json.dumps(meta))
    with pytest.raises(QgtrainError, match=f"load_model: class '{name}.Model' in {folder}"):
        qgtrain.load_model(folder)
    assert not (tmp_path / "code" / "imported").exists()
    assert type(qgtrain.load_model(folder, trust_code=True)).__name__ == "Linear"
    assert (tmp_path / "code" / "imported").exists()

    meta = {"format": 1, "kind": "transformers", "class": "transformers.pipeline"}
    (folder / "qgtrain_model.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="'transformers.pipeline' .* is not a transformers"):
        qgtrain.load_model(folder)


def test_only_the_built_in_language_model_and_transformers_model_classes_are_built_in():
    assert Named("task.factory", BUILTIN_LM).builtin()
    assert Named("class", "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel").builtin()
    # called with the artifact's config, it would submit that config (its slurm.setup) as your job
    assert not Named("task.factory", "qgtrain.launch.submitit_launcher:submit").builtin()
    assert not Named("model.factory", "transformers:AutoModelForCausalLM").builtin()
    assert not Named("class", "transformers_evil.Model").builtin()
    assert not Named("class", "torch.nn.Linear").builtin()
    lm = load_config(
        [], ["model.factory=tests.factories:tiny", "data.name=factory", "data.factory=x:y"]
    )
    assert config_code(lm) == [Named("model.factory", "tests.factories:tiny")]  # no LM data built
    task = load_config([], ["task=x:task", "data.name=factory", "data.factory=x:data"])
    assert config_code(task) == [Named("task.factory", "x:task"), Named("data.factory", "x:data")]
    assert config_code(load_config([], [])) == []
