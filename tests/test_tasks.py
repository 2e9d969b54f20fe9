"""The Task contract: any model, data, loss and metrics, with every guarantee kept. Runs against:
real `qgtrain train` processes (1 and 2 ranks, gloo) on the tasks of tests/tasks.py, a real 3-rank
group for exact metrics, and qgtrain.train called from a script the way a user's srun or torchrun
job would."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qgtrain.data.batches import to_device
from qgtrain.foundation.errors import TaskError
from tests.helpers import cli, records, train_command
from tests.ranks import ROOT, free_port, run_ranks, start_cli_ranks, torchrun_variables, wait_ranks

BASE = [
    "train.batch_size=8",
    "train.max_steps=12",
    "train.log_every=1",
    "train.eval_every=4",
    "checkpoint.every_steps=4",
    "logging.tensorboard=false",
    "optim.warmup_steps=2",
]


def qgtrain(tmp_path: Path, task: str, *sets: str) -> subprocess.CompletedProcess[str]:
    return cli(
        *train_command(tmp_path / "run", f"task=tests.tasks:{task}", *BASE, *sets),
        cwd=tmp_path,
        timeout=180,
    )


Named = collections.namedtuple("Named", "ids mask")


@dataclasses.dataclass
class Graphish:
    nodes: torch.Tensor
    count: int


class Movable:
    def __init__(self) -> None:
        self.moved_to: torch.device | None = None

    def to(self, device: torch.device) -> Movable:
        self.moved_to = device
        return self


def test_batches_of_any_structure_reach_the_device():
    meta = torch.device("meta")
    own = Movable()
    batch = {
        "ids": torch.ones(2, 3),
        "pair": (torch.zeros(1), [torch.ones(1), 7]),
        "named": Named(torch.ones(1), None),
        "graph": Graphish(torch.ones(4), 4),
        "own": own,
        "text": "kept",
        "array": __import__("numpy").ones(2),
    }
    moved = to_device(batch, meta)
    assert (
        moved["ids"].device == meta
        and moved["pair"][0].device == meta
        and moved["pair"][1][0].device == meta
    )
    assert (
        moved["pair"][1][1] == 7
        and isinstance(moved["pair"], tuple)
        and isinstance(moved["pair"][1], list)
    )
    assert (
        isinstance(moved["named"], Named)
        and moved["named"].ids.device == meta
        and moved["named"].mask is None
    )
    assert (
        isinstance(moved["graph"], Graphish)
        and moved["graph"].nodes.device == meta
        and moved["graph"].count == 4
    )
    assert own.moved_to == meta and moved["text"] == "kept" and moved["array"] is batch["array"]
    assert batch["ids"].device.type == "cpu", "the batch itself is left as it was"


def test_a_batch_part_that_cannot_be_moved_is_named():
    class Opaque:
        pass

    with pytest.raises(
        TaskError, match=r"the batch\['graph'\]\.nodes is a .*Opaque, which qgtrain cannot move"
    ):
        to_device({"graph": Graphish(Opaque(), 1)}, torch.device("meta"))  # type: ignore[arg-type]


def evaluate_points(size: int, batch_size: int) -> dict[str, float | None]:
    """One rank of an evaluation of a fixed model on `size` points, in a real process group."""
    from qgtrain.data.loaders import EvalShard, make_loader
    from qgtrain.runtime.distributed import process_group
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.training.evaluation import evaluate
    from tests.tasks import Points, accuracy, classify_loss

    env = from_environ(os.environ)
    with process_group(env, torch.device("cpu"), 60, 60):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        data = Points(size, 5)
        loader = make_loader(
            data, EvalShard(data, env), batch_size, 0, torch.device("cpu"), 0, False
        )
        return evaluate(model, loader, classify_loss, accuracy, torch.device("cpu"), "fp32", 0)


def test_metrics_are_exact_over_the_whole_split_on_uneven_shards():
    """10 points on 3 ranks in batches of 4: shards of 4, 3 and 3 samples, a last batch shorter than
    the others. Means of per-rank means would weigh them wrongly; sums over counts do not."""
    alone = run_ranks(1, evaluate_points, 10, 4)[0]
    three = run_ranks(3, evaluate_points, 10, 4)
    assert all(result == three[0] for result in three), "every rank reports the same values"
    assert three[0]["accuracy"] == alone["accuracy"] and alone["accuracy"] is not None
    # Each batch's loss is a float32 mean over other samples on 3 ranks (batches of 4, 3, 3) than on
    # one (4, 4, 2): the two agree to float32 rounding, about 1e-7 per sum over ten samples, not bit
    # for bit (under ATEN_CPU_CAPABILITY=default they differ by 1.9e-8). A mean of per-rank means
    # would be off by far more.
    assert three[0]["loss"] == pytest.approx(alone["loss"], rel=1e-6)
    assert 0 < alone["accuracy"] < 1 and alone["accuracy"] * 10 == round(alone["accuracy"] * 10)


@pytest.mark.parametrize(
    "task, sets, code, message",
    [
        ("no_such_function", (), 2, "task.factory: cannot load 'tests.tasks:no_such_function'"),
        (
            "not_a_task",
            (),
            3,
            "task.factory: tests.tasks:not_a_task returned int, not a qgtrain.Task",
        ),
        (
            "model_is_not_a_module",
            (),
            3,
            "the task of tests.tasks:model_is_not_a_module has model=str; it "
            "must be a torch.nn.Module",
        ),
        (
            "loss_is_not_a_scalar",
            (),
            3,
            "task: loss(model, batch) returned a tensor of shape (8,); it must "
            "return a floating-point scalar tensor",
        ),
        (
            "batch_cannot_move",
            (),
            3,
            "task: the batch['x'] is a tests.tasks.Opaque, which qgtrain cannot move to cpu",
        ),
        (
            "points",
            ("early_stopping.metric=val_f1",),
            2,
            "early_stopping.metric: val_f1 is not reported by "
            "the task (it reports val_loss, val_accuracy)",
        ),
        (
            "without_metrics",
            ("early_stopping.metric=val_accuracy",),
            2,
            "reports no metrics, but early_stopping.metric is val_accuracy",
        ),
        (
            "endless_train",
            (),
            3,
            f"has train=Endless, whose len() is {sys.maxsize} (sys.maxsize: an endless "
            "stream, not a count of samples); it must be a map-style dataset",
        ),
        (
            "streamed_val",
            (),
            3,
            "has val=Stream, an IterableDataset; validation and test splits must be "
            "map-style (__len__ and __getitem__: every sample evaluated exactly once over "
            "all ranks), or None",
        ),
    ],
)
def test_a_broken_task_is_one_line_naming_what_is_wrong_exit_2_for_config_3_for_code(
    tmp_path, task, sets, code, message
):
    """A config value to change exits 2; the task's own code breaking the Task contract exits 3."""
    result = qgtrain(tmp_path, task, *sets)
    assert result.returncode == code, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("qgtrain: error: ") and message in last, last


def test_a_dataclass_batch_trains_and_reports_exact_metrics_with_early_stopping_on_the_maximum(
    tmp_path,
):
    result = qgtrain(
        tmp_path,
        "as_dataclass",
        "train.max_steps=200",
        "early_stopping.metric=val_accuracy",
        "early_stopping.mode=max",
        "early_stopping.patience=2",
        "early_stopping.min_delta=0.5",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    run = tmp_path / "run"
    evaluated = [r for r in records(run) if "val_accuracy" in r]
    assert [r["step"] for r in evaluated] == [4, 8, 12], (
        "no gain of 0.5 after the first validation: stop at 12"
    )
    assert evaluated[-1]["test_accuracy"] is not None and "samples_per_s" in evaluated[-1]
    assert "tokens_per_s" not in evaluated[-1], "the task says nothing about tokens"
    manifest = json.loads((run / "checkpoints" / "step-12" / "manifest.json").read_text())
    assert manifest["score"] == {
        "metric": "val_accuracy",
        "mode": "max",
        "value": evaluated[-1]["val_accuracy"],
    }
    state = json.loads((run / "checkpoints" / "step-12" / "state.json").read_text())["trainer"]
    assert (
        state["outcome"] == "stopped early" and state["best_metric"] == evaluated[0]["val_accuracy"]
    )
    shown = subprocess.run(
        [sys.executable, "-m", "qgtrain", "runs", str(run), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(shown.stdout)[0]["last_val_metrics"] == {
        "val_accuracy": evaluated[-1]["val_accuracy"]
    }


@pytest.mark.slow
@pytest.mark.parametrize("where", ["loss", "collate", "dataset"])
def test_a_task_that_raises_on_one_rank_stops_every_rank_with_that_ranks_message(tmp_path, where):
    run = tmp_path / "run"
    started = time.monotonic()
    procs = start_cli_ranks(
        2,
        train_command(
            run,
            "task=tests.tasks:raises_on_rank_one",
            f"task.options.where={where}",
            *BASE,
            "train.max_steps=1000",
            "train.collective_timeout_s=120",
        ),
        tmp_path,
    )
    assert wait_ranks(procs, 100) == [1, 1]
    assert time.monotonic() - started < 60, (
        "the other rank learns of the failure at once, not at a timeout"
    )
    rank0 = (tmp_path / "rank-0.out").read_text()
    assert "rank 1 failed: ValueError: sample 17 has no label" in rank0.strip().splitlines()[-1]
    assert "ValueError: sample 17 has no label" in (tmp_path / "rank-1.out").read_text()
    status = json.loads((run / "status.json").read_text())
    assert (
        status["status"] == "failed" and "rank 1 failed: ValueError: sample 17" in status["error"]
    )


def test_a_peer_that_vanishes_before_training_is_the_machines_failure_and_may_be_retried(tmp_path):
    """A rank lost while the task is built breaks rank 0's first collective outside the step loop:
    that is a peer failure, which the batch script retries, not the run's own failure, which it
    would not."""
    run = tmp_path / "run"
    procs = start_cli_ranks(
        2,
        ["train", "--run-dir", str(run), "--set", "task=tests.tasks:vanishes_on_rank_one", *BASE],
        tmp_path,
    )
    assert wait_ranks(procs, 100) == [1, 137]
    said = (tmp_path / "rank-0.out").read_text().strip().splitlines()[-1]
    assert (
        "a collective failed outside the step loop on rank 0: rank(s) [1] did not arrive" in said
    ), said
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and status["retryable"] is True, status
    assert not (run / "logs" / "failed-rank-0.txt").exists(), (
        "a note would tell the batch script not to retry"
    )


SCRIPT = """
import sys
import qgtrain
from tests.tasks import points

if __name__ == "__main__":
    run_dir, *sets = sys.argv[1:]
    raise SystemExit(qgtrain.train(qgtrain.load_config([], sets), task=points, run_dir=run_dir))
"""


def train_from_python(run_dir: str) -> dict[str, object]:
    """One rank of a user's script: qgtrain.train(cfg, task=build), its result as plain data."""
    import qgtrain
    from tests.tasks import points

    result = qgtrain.train(qgtrain.load_config([], BASE), task=points, run_dir=run_dir)
    return {
        "int": isinstance(result, int),
        "code": int(result),
        "run_dir": result.run_dir,
        "step": result.step,
        "metrics": result.metrics,
    }


def test_qgtrain_train_returns_the_exit_code_with_the_run_dir_last_step_and_figures(tmp_path):
    (result,) = run_ranks(1, train_from_python, str(tmp_path / "run"))
    assert result["int"] and result["code"] == 0
    assert result["run_dir"] == (tmp_path / "run").resolve() and result["run_dir"].is_dir()
    assert result["step"] == 12  # BASE's train.max_steps
    last = records(tmp_path / "run")[-1]
    for name in ("loss", "val_loss", "val_accuracy", "test_loss", "test_accuracy"):
        assert name in result["metrics"], result["metrics"]
    assert {k: v for k, v in last.items() if k.startswith(("val_", "test_"))}.items() <= (
        result["metrics"].items()
    )
    code = "import sys, qgtrain; sys.exit(qgtrain.TrainResult(75, '/runs/x', 3, {'loss': 1.0}))"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 75, "sys.exit(result) exits"


def test_dir_of_the_package_lists_what_it_exports():
    import qgtrain

    assert set(qgtrain.__all__) <= set(dir(qgtrain))
    assert {"train", "load_config", "load_model", "submit", "TrainResult"} <= set(dir(qgtrain))


def run_script(script: Path, run: Path, *sets: str) -> list[int]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(run), *BASE, *sets],
            cwd=script.parent,
            env={**os.environ, "PYTHONPATH": str(ROOT), **torchrun_variables(r, 2, port)},
        )
        for r in (0, 1)
    ]
    return [p.wait(timeout=120) for p in procs]


def test_a_restart_refused_for_a_changed_model_leaves_the_runs_status_as_it_was(tmp_path):
    """A changed task.options that no longer fits the checkpoint is bad input to a restart, refused
    before any step: the finished run stays finished, its status.json not rewritten at all."""
    done = qgtrain(tmp_path, "drawn_after_model", "task.options.width=16")
    assert done.returncode == 0, done.stderr[-3000:]
    status = tmp_path / "run" / "status.json"
    before = status.read_bytes()
    assert json.loads(before)["status"] == "finished"
    refused = qgtrain(tmp_path, "drawn_after_model", "task.options.width=24")
    assert refused.returncode == 2, refused.stderr[-3000:]
    said = refused.stderr.strip().splitlines()[-1]
    assert said.startswith("qgtrain: error: ") and "does not fit the configured model" in said
    assert status.read_bytes() == before


def test_qgtrain_train_from_a_script_under_torchrun_variables_resumes_and_records_the_task(
    tmp_path,
):
    script, run = tmp_path / "my_job.py", tmp_path / "run"
    script.write_text(SCRIPT)
    assert run_script(script, run) == [0, 0]
    assert records(run)[-1]["val_accuracy"] is not None and records(run)[-1]["step"] == 12
    assert "factory: tests.tasks:points" in (run / "config.yaml").read_text(), (
        "export can rebuild the task"
    )
    # a longer run after the end: a new decay from the current rate (a bare change would be refused)
    assert run_script(script, run, "train.max_steps=16", "optim.rewarm_steps=0") == [0, 0]
    assert (
        "resumed from" in (run / "logs" / "rank_0.log").read_text()
        and records(run)[-1]["step"] == 16
    )


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_rank_0_that_builds_its_task_for_longer_than_a_collective_may_wait_still_trains(
    tmp_path, parallel
):
    """The ranks wait for a slow rank 0 (a large model read from a shared filesystem) up to
    train.startup_timeout_s, not train.collective_timeout_s: here 6 s of building against 2 s."""
    sharding = ["train.parallel=fsdp", "train.shard_modules=[Linear]"] if parallel == "fsdp" else []
    procs = start_cli_ranks(
        2,
        train_command(
            tmp_path / "run",
            "task=tests.tasks:slow_on_rank_zero",
            "task.options={build_s: 6}",
            "train.collective_timeout_s=2",
            *sharding,
            *BASE,
        ),
        tmp_path,
    )
    assert wait_ranks(procs, 120) == [0, 0], (tmp_path / "rank-1.out").read_text()[-2000:]
    trained = records(tmp_path / "run")
    assert [r["step"] for r in trained] == list(range(1, 13)), "every step trained"
    assert sum(trained[0]["startup_s"].values()) >= 6, "the start waited out rank 0's build"
