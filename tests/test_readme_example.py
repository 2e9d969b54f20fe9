"""The own-model examples of README.md and docs/, as a user copies them: README's `# my_task.py`
block saved in a folder of their own and the command below it run there as written (the venv's
qgtrain, nothing of this repository on the path), then run again, which must find the run
finished; the same task trained from Python by the page's train_mine.py, given its own optimizer
by the recipe page's my_sgd_task.py, and its export loaded in another folder by the export page's
lines. Each python block is read from its page (tests/doc_blocks.py), so a page that changes is
what runs."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.doc_blocks import python_block
from tests.helpers import cli, train_command
from tests.ranks import ROOT

README = ROOT / "README.md"
TASK = python_block("README.md", "# my_task.py")


def readme_command() -> list[str]:
    """The arguments after `qgtrain` of README's command that trains the task."""
    text = README.read_text()
    command = re.search(r"```bash\n(qgtrain train --set task=my_task\.py:build[^\n]*)\n```", text)
    assert command, "README.md's own-model command moved: update this test"
    return shlex.split(command.group(1))[1:]


def as_a_user(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """`args` run by the venv's python, nothing of this repository on the path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def mine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of the user's own: README's task file, trained there by README's command."""
    folder = tmp_path_factory.mktemp("mine")
    (folder / "my_task.py").write_text(TASK)
    done = as_a_user(["-m", "qgtrain", *readme_command()], folder)
    assert done.returncode == 0, done.stderr[-3000:]
    return folder


@pytest.mark.slow
def test_the_own_model_example_trains_as_written_and_a_second_start_finds_it_finished(mine):
    (run,) = (mine / "runs").iterdir()
    written = (run / "metrics.jsonl").read_text()
    logged = [json.loads(line) for line in written.splitlines()]
    final = [r for r in logged if "test_accuracy" in r][-1]
    assert final["test_accuracy"] > 0.9 and final["val_accuracy"] > 0.9, final
    again = as_a_user(["-m", "qgtrain", *readme_command()], mine)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "this run already ended at step" in again.stderr + again.stdout
    assert (run / "metrics.jsonl").read_text() == written, "a finished run took more steps"


@pytest.mark.slow
def test_the_own_model_page_trains_the_task_from_python(tmp_path):
    task = python_block("docs/own-model.md", "# my_task.py")
    assert task == TASK, "the page's task file is README's"
    (tmp_path / "my_task.py").write_text(task)
    (tmp_path / "train_mine.py").write_text(python_block("docs/own-model.md", "# train_mine.py"))
    shutil.copy(ROOT / "config.yaml", tmp_path / "config.yaml")
    done = as_a_user(["train_mine.py"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    run_dir, step, accuracy = done.stdout.split()[-3:]
    assert Path(run_dir).is_dir() and step == "600" and float(accuracy) > 0.9, done.stdout


def test_the_recipe_pages_optimizer_trains_the_task(mine):
    (mine / "my_sgd_task.py").write_text(python_block("docs/recipe.md", "def my_optimizer"))
    run = mine / "sgd"
    done = cli(
        *train_command(run, "task=my_sgd_task.py:build", "optim.lr=0.05", "train.max_steps=20"),
        cwd=mine,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    state = (run / "checkpoints" / "step-20" / "state.json").read_text()
    assert "torch.optim.sgd.SGD" in state, "the task's optimizer trained the run"
    saved = torch.load(run / "checkpoints" / "step-20" / "optim.pt", weights_only=True)
    lrs = [group["lr"] for group in saved["optimizer"]["param_groups"]]
    assert len(lrs) == 2 and lrs[1] == pytest.approx(lrs[0] / 10), lrs


def test_the_export_pages_lines_load_the_task_elsewhere(mine, tmp_path):
    (run,) = (p for p in (mine / "runs").iterdir() if p.is_dir())
    done = cli("export", str(run), "--out", str(mine / "models" / "mlp"), cwd=mine)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.copytree(mine / "models", tmp_path / "models")
    load = python_block("docs/export.md", 'load_model("models/mlp"')
    done = as_a_user(["-c", load + "print(type(model).__name__, model.training)\n"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["MyNet", "False"], done.stdout
