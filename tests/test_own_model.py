"""A model of your own after training: `qgtrain eval` scores its checkpoints and its export on the
task's own loss and metrics, giving the figures the loop logged; its export carries the task's code
and loads anywhere. Runs against: real `qgtrain` processes (2 training ranks, eval on 1 and 2), an
MLP task file in a folder outside the repository that imports a helper module of its own folder and
makes its own data, run from another working directory; the export moved away, the task file and
its helper deleted, loaded in a fresh interpreter elsewhere."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qgtrain.config.load import load_config
from qgtrain.ops.export.bundle import bundled, local_files, resolved
from tests.helpers import ROOT, cli, one_error_line, records, train_command
from tests.ranks import start_cli_ranks, wait_ranks

STEPS, EVERY = 6, 2
KEPT = list(range(EVERY, STEPS + 1, EVERY))
HELPER = """
import torch
from torch import nn
from torch.utils.data import TensorDataset


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, width), nn.Tanh(), nn.Linear(width, 3))

    def forward(self, x):
        return self.net(x)


def points(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())
"""
TASK = """
import torch.nn.functional as F

import qgtrain
from own_mlp_parts import MLP, points


def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def metrics(model, batch):
    x, y = batch
    return {"accuracy": ((model(x).argmax(1) == y).sum(), len(y))}


def build(cfg):
    # val and test end in uneven last batches on each of 2 ranks
    return qgtrain.Task(model=MLP(cfg.task.options.get("width", 16)), train=points(256, 0),
                        val=points(50, 1), test=points(37, 2), loss=loss, metrics=metrics)
"""
# the outputs of the exported model on a fixed input, printed as JSON, or its refusal in one line
LOAD = """
import json, sys, torch, qgtrain
from qgtrain.foundation.errors import QgtrainError
try:
    model = qgtrain.load_model(sys.argv[1], trust_code=sys.argv[2] == "trust")
except QgtrainError as exc:
    print(f"refused: {exc}")
    sys.exit(2)
print(json.dumps(model(torch.linspace(-2, 2, 12).reshape(3, 4)).tolist()))
"""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(the task's folder, the working folder the commands run in, a 2-rank run of the task)."""
    top = tmp_path_factory.mktemp("own-model")
    project, work = top / "project", top / "work"
    project.mkdir()
    work.mkdir()
    (project / "own_mlp_parts.py").write_text(HELPER)
    (project / "my_task.py").write_text(TASK)
    run = top / "run"
    args = train_command(
        run,
        f"task={project / 'my_task.py'}:build",
        f"train.max_steps={STEPS}",
        "train.batch_size=8",
        f"train.eval_every={EVERY}",
        "train.eval_batches=0",  # the whole split, as `qgtrain eval` scores it
        f"checkpoint.every_steps={EVERY}",
        "checkpoint.keep_last=10",
        "train.log_every=2",
        "optim.warmup_steps=0",
        "logging.tensorboard=false",
    )
    codes = wait_ranks(start_cli_ranks(2, args, work, log_prefix="train"), 300)
    assert codes == [0, 0], (work / "train-0.out").read_text()[-3000:]
    return project, work, run


def loop_figures(run: Path) -> dict[int, dict[str, float]]:
    """The loop's validation (and, at the end, test) figures of each step that validated."""
    return {
        r["step"]: {k: v for k, v in r.items() if k.startswith(("val_", "test_"))}
        for r in records(run)
        if "val_loss" in r
    }


def scored(results: Path) -> dict[tuple[int | None, str], dict[str, float]]:
    lines = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
    return {
        (line["step"], line["task"]): {
            k: v for k, v in line.items() if k.startswith(("val_", "test_"))
        }
        for line in lines
    }


@pytest.mark.slow
def test_qgtrain_eval_gives_the_loops_figures_at_every_kept_step_on_one_and_two_ranks(trained):
    _, work, run = trained
    loop = loop_figures(run)
    assert sorted(loop) == KEPT and "test_loss" in loop[STEPS], loop

    one = cli("eval", str(run), "--all", cwd=work)  # default: val, there being no eval.tasks
    assert one.returncode == 0, one.stderr[-3000:]
    alone = scored(run / "eval" / "results.jsonl")
    assert sorted(alone) == [(step, "val") for step in KEPT]
    for step in KEPT:  # one rank batches the split otherwise: the loss's last bits may differ
        assert alone[(step, "val")]["val_loss"] == pytest.approx(loop[step]["val_loss"], rel=1e-6)
        assert alone[(step, "val")]["val_accuracy"] == loop[step]["val_accuracy"]
    assert "val_loss" in one.stdout and "val_accuracy" in one.stdout, "the console's table"
    again = cli("eval", str(run), "--all", cwd=work)
    assert again.returncode == 0 and "already scored" in again.stderr, again.stderr[-3000:]
    assert scored(run / "eval" / "results.jsonl") == alone, "each step scored once"

    out = work / "two-ranks"
    ranks = start_cli_ranks(
        2, ["eval", str(run), "--all", "--split", "val,test", "--out", str(out)], work, {}, "eval"
    )
    assert wait_ranks(ranks, 300) == [0, 0], (work / "eval-0.out").read_text()[-3000:]
    both = scored(out / "results.jsonl")
    assert sorted(both) == sorted((step, split) for step in KEPT for split in ("val", "test"))
    for step in KEPT:  # the loop's own computation: the same bits
        val = both[(step, "val")]
        assert val == {
            "val_loss": loop[step]["val_loss"],
            "val_accuracy": loop[step]["val_accuracy"],
        }
    final = {k: v for k, v in loop[STEPS].items() if k.startswith("test_")}
    assert both[(STEPS, "test")] == final


@pytest.mark.slow
def test_an_export_carries_its_task_code_and_loads_anywhere_after_the_files_are_gone(trained):
    project, work, run = trained
    export = work / "export"
    done = cli("export", str(run), "--out", str(export), cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    meta = json.loads((export / "qgtrain_model.json").read_text())
    assert meta["task"] == meta["config"]["task"]["factory"] == "code/my_task.py:build"
    assert (export / "code" / "my_task.py").read_text() == TASK
    assert (export / "code" / "own_mlp_parts.py").read_text() == HELPER
    assert (
        'qgtrain.load_model("path/to/this/folder", trust_code=True)'
        in (export / "README.md").read_text()
    )
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    before = load(export, elsewhere)

    moved = work.parent / "moved" / "mlp"
    moved.parent.mkdir()
    shutil.move(str(export), str(moved))
    kept = {path: path.read_text() for path in project.iterdir() if path.suffix == ".py"}
    try:
        for path in kept:
            path.unlink()
        assert load(moved, elsewhere) == before, "the same model, from its own copy of the code"
        refused = run_load(moved, elsewhere, "no")
        assert refused.returncode == 2 and refused.stdout.count("\n") == 1, refused.stderr
        assert "task.factory 'code/my_task.py:build'" in refused.stdout
        assert "HINT: read that code; if you trust it, pass trust_code=True" in refused.stdout

        line = one_error_line(cli("eval", str(moved), cwd=elsewhere))
        assert "eval: task.factory 'code/my_task.py:build'" in line and "--trust-code" in line
        done = cli("eval", str(moved), "--trust-code", "--split", "val,test", cwd=elsewhere)
        assert done.returncode == 0, done.stderr[-3000:]
    finally:
        for path, text in kept.items():
            path.write_text(text)
    figures = scored(moved / "eval" / "results.jsonl")
    loop = loop_figures(run)[STEPS]
    assert figures[(None, "val")]["val_loss"] == pytest.approx(loop["val_loss"], rel=1e-6)
    assert figures[(None, "test")]["test_accuracy"] == loop["test_accuracy"]


def run_load(folder: Path, cwd: Path, trust: str) -> subprocess.CompletedProcess[str]:
    """LOAD on an exported folder (its code trusted if `trust` == "trust"), in a new interpreter."""
    return subprocess.run(
        [sys.executable, "-c", LOAD, str(folder), trust],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )


def load(folder: Path, cwd: Path) -> list[list[float]]:
    """The exported model's outputs on a fixed input, from a fresh interpreter in `cwd`."""
    done = run_load(folder, cwd, "trust")
    assert done.returncode == 0, done.stderr[-3000:]
    return list(json.loads(done.stdout))


@pytest.mark.slow
def test_the_causal_lms_val_loss_is_scored_again_as_the_loop_scored_it(tmp_path):
    run = tmp_path / "lm"
    trained = cli(
        *train_command(
            run,
            "data.name=synthetic",
            "data.seq_len=16",
            "model.factory=tests.factories:tiny",
            "train.batch_size=4",
            "train.max_steps=2",
            "train.eval_every=2",
            "train.eval_batches=0",
            "checkpoint.every_steps=2",
            "logging.tensorboard=false",
            "optim.warmup_steps=0",
        ),
        cwd=tmp_path,
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    done = cli("eval", str(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert scored(run / "eval" / "results.jsonl") == {
        (2, "val"): {"val_loss": loop_figures(run)[2]["val_loss"]}
    }


def test_the_modules_a_task_file_imports_from_its_folder_are_found_by_reading_it(tmp_path):
    """Every import form, followed from module to module; names of installed modules, folders of
    data and files outside the task's folder tree are left; nothing is run."""
    project = tmp_path / "project"
    (project / "pkg" / "deep").mkdir(parents=True)
    (project / "data").mkdir()  # a folder of data that shares a module's name
    files = {
        "my_task.py": "import os, helper\nfrom pkg import sub\nimport data\n"
        "def build(cfg):\n    from pkg.deep.leaf import f\n",
        "helper.py": "raise SystemExit('run')\nimport json\nfrom pkg.sub import g\n",
        "pkg/__init__.py": "",
        "pkg/sub.py": "from . import sibling\nfrom ... import outside\n",
        "pkg/sibling.py": "",
        "pkg/deep/leaf.py": "from ..sub import g\n",
        "unused.py": "",
        "data/rows.py": "",
    }
    for name, text in files.items():
        (project / name).write_text(text)
    (tmp_path / "outside.py").write_text("")
    found = {p.relative_to(project).as_posix() for p in local_files(project / "my_task.py")}
    assert found == {
        "my_task.py",
        "helper.py",
        "pkg/__init__.py",
        "pkg/sub.py",
        "pkg/sibling.py",
        "pkg/deep/leaf.py",
    }

    cfg = load_config([], [f"task={project / 'my_task.py'}:build"])
    export = tmp_path / "export"
    export.mkdir()
    shown, copied = bundled(cfg, export)
    assert shown.task.factory == "code/my_task.py:build" and "code/pkg/deep/leaf.py" in copied
    assert resolved(shown, export).task.factory == f"{export.resolve()}/code/my_task.py:build"
    named = bundled(load_config([], ["task=tests.tasks:points"]), export)[0].task.factory
    assert named == "tests.tasks:points", "a module of a package is recorded by name"
