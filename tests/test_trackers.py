"""W&B and MLflow trackers across kills and resumes. Runs against: the real libraries, W&B in
offline mode (its transaction log read back record by record) and MLflow's file store, and real
`qgtrain train` processes SIGKILLed after a checkpoint and started again."""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import cli, records, wait_for
from tests.ranks import ROOT, ForkedCommand

SETS = [
    "data.name=synthetic",
    "data.synthetic_samples=1024",
    "data.seq_len=32",
    "model.hidden=32",
    "model.layers=1",
    "model.heads=2",
    "train.batch_size=4",
    "train.log_every=2",
    "train.eval_every=0",
    "checkpoint.every_steps=10",
    "logging.tensorboard=false",
    "logging.trackers=[wandb, mlflow]",
]


@pytest.fixture(autouse=True)
def tracker_variables_stay_in_the_test():
    """qgtrain turns on MLflow's file store, and wandb.init records its service's address, in
    os.environ of the process that logs: here pytest's own, which every later test and Slurm job
    would inherit."""
    saved = {name: os.environ.get(name) for name in ("MLFLOW_ALLOW_FILE_STORE", "WANDB_SERVICE")}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def arguments(tmp_path: Path, *sets: str) -> list[str]:
    return [
        "train",
        "--config",
        str(ROOT / "config.yaml"),
        "--set",
        *SETS,
        f"logging.runs_dir={tmp_path / 'runs'}",
        *sets,
    ]


def run(tmp_path: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    return cli(*arguments(tmp_path, *sets), cwd=tmp_path, env={"WANDB_SILENT": "true"})


def wandb_steps(offline_run: Path) -> tuple[set[str], list[int]]:
    """Run ids and history steps of one offline W&B run folder, in the order written."""
    from wandb.proto import wandb_internal_pb2

    ids, steps = set(), []
    for path in sorted(offline_run.glob("run-*.wandb")):
        for raw in _log_records(path.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.add(record.run.run_id)
            elif kind == "history":
                steps.append(record.history.step.num)
    return ids, steps


def written_soon(read, expected, timeout: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    """Whether `read()` gives `expected` within `timeout` s: W&B's service process (wandb-core)
    writes an offline run's file itself and may flush its last block just after run.finish()
    returns to this process (a CI run under load read it empty once)."""
    deadline = time.monotonic() + timeout
    while read() != expected:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _log_records(data: bytes) -> list[bytes]:
    """W&B's .wandb file: a 7-byte header, then LevelDB's log format (32 KiB blocks of CRC, length,
    type, payload; types 1 full, 2 first, 3 middle, 4 last)."""
    out, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 1:
            out.append(chunk)
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            out.append(pending + chunk)
    return out


def mlflow_metric(tmp_path: Path, run_id: str, key: str) -> list[tuple[int, float]]:
    (path,) = (tmp_path / "runs" / "mlruns").glob(f"*/{run_id}/metrics/{key}")
    return [
        (int(step), float(value))
        for _, value, step in (line.split() for line in path.read_text().splitlines())
    ]


@pytest.mark.slow
def test_a_killed_and_resumed_run_is_one_tracker_run_with_one_step_axis(tmp_path):
    run_dir = tmp_path / "runs" / "tiny-gpt2"
    proc = ForkedCommand(
        arguments(tmp_path, "train.max_steps=400"),
        tmp_path,
        {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_SILENT": "true"},
        tmp_path / "killed.out",
    )
    past_the_checkpoint = lambda: any(r["step"] >= 16 for r in records(run_dir)[-1:])  # noqa: E731
    wait_for(past_the_checkpoint, [proc], "step 16, past the checkpoint at 10", 240, 0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    first = json.loads((run_dir / "trackers.json").read_text())
    assert set(first) == {"wandb_id", "mlflow_id"}, (
        "the ids, written before the first value; steps are the trackers'"
    )
    killed_steps = [step for step, _ in mlflow_metric(tmp_path, first["mlflow_id"], "loss")]
    assert killed_steps[-1] >= 14 and killed_steps == sorted(set(killed_steps))

    done = run(tmp_path, "train.max_steps=30")
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stderr and "could not start" not in done.stderr
    state = json.loads((run_dir / "trackers.json").read_text())
    assert (state["wandb_id"], state["mlflow_id"]) == (first["wandb_id"], first["mlflow_id"])

    losses = {r["step"]: r["loss"] for r in records(run_dir) if "loss" in r}
    # the checkpoint at 10, or at 20 where the killed run got there before the kill landed
    resumed_at = int(re.search(r"resumed from \S*step-(\d+)", done.stderr).group(1))
    assert resumed_at in (10, 20), done.stderr
    # a start always logs its first step
    first_step = resumed_at + 1
    assert list(losses) == [1, *range(2, first_step, 2), first_step, *range(first_step + 1, 31, 2)]
    # W&B offline buffers (a killed job may leave nothing on disk): the newest offline file replays
    # the history up to the resumed step, so it alone holds the whole axis, whatever the killed one
    # kept.
    files = sorted(run_dir.glob("wandb/offline-run-*"))
    ids, steps = wandb_steps(files[-1])
    assert len(files) == 2 and ids == {state["wandb_id"]} == wandb_steps(files[0])[0] | ids
    assert steps == list(losses), "one step axis: nothing twice, nothing backwards, nothing lost"
    # MLflow writes as it is called: the killed job's steps (up to at least 14) stay; the resumed
    # one starts at its first step, which would go backwards, and sends only what MLflow lacks.
    expected = [step for step in losses if step != first_step]
    logged = mlflow_metric(tmp_path, state["mlflow_id"], "loss")
    assert [step for step, _ in logged] == expected
    assert [value for _, value in logged] == [losses[step] for step in expected], "resume is exact"


def test_a_resumed_mlflow_run_sends_each_metric_from_where_mlflow_has_it(tmp_path):
    """A kill can land between MLflow's write and anything we would record about it, or half-way
    through one step's metrics: what a start skips comes from MLflow's own history, per metric, so
    nothing is sent twice and nothing is lost."""
    from qgtrain.config import LoggingConfig
    from qgtrain.training.trackers import open_trackers

    cfg = LoggingConfig(runs_dir=str(tmp_path / "runs"), trackers=("mlflow",))
    (first,) = open_trackers(cfg, tmp_path, "run", {"train": {"seed": 1}}, environ={})
    for step in (2, 4, 6):
        first.log({"step": step, "loss": step / 10, "lr": 1e-3, "time": 0.0})
    # killed after the loss of step 8 was written, before its lr
    first.opened.send(8, {"loss": 0.8})
    (again,) = open_trackers(cfg, tmp_path, "run", {}, environ={})
    assert again.opened.run_id == first.opened.run_id and again.opened.last_steps == {
        "loss": 8,
        "lr": 6,
    }
    for step in (6, 8, 10):  # the resumed run logs from its checkpoint at step 5
        again.log({"step": step, "loss": step / 10, "lr": 2e-3, "time": 0.0})
    run_id = first.opened.run_id
    assert mlflow_metric(tmp_path, run_id, "loss") == [
        (2, 0.2),
        (4, 0.4),
        (6, 0.6),
        (8, 0.8),
        (10, 1.0),
    ]
    assert [step for step, _ in mlflow_metric(tmp_path, run_id, "lr")] == [2, 4, 6, 8, 10]


def test_trackers_follow_their_own_environment_variables(tmp_path, caplog):
    """A site that runs an MLflow server, or keeps W&B files elsewhere, sets the libraries' own
    variables once for every tool; qgtrain honours them where its config keeps the default, and says
    which it used."""
    from qgtrain.config import LoggingConfig
    from qgtrain.training.trackers import open_trackers

    store, wandb_dir, run_dir = (
        tmp_path / "site-mlruns",
        tmp_path / "site-wandb",
        tmp_path / "runs" / "run",
    )
    run_dir.mkdir(parents=True)
    wandb_dir.mkdir()
    environ = {
        "MLFLOW_TRACKING_URI": store.as_uri(),
        "MLFLOW_EXPERIMENT_NAME": "site-experiment",
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(wandb_dir),
        "WANDB_PROJECT": "site-project",
    }
    cfg = LoggingConfig(runs_dir=str(tmp_path / "runs"), trackers=("mlflow", "wandb"))
    with caplog.at_level("INFO", logger="qgtrain"):
        opened = open_trackers(cfg, run_dir, "run", {}, environ=environ)
    assert [t.name for t in opened] == ["mlflow", "wandb"] and not any(t.broken for t in opened)
    for tracker in opened:
        tracker.log({"step": 1, "loss": 1.5})
        tracker.close(True)
    run_id = opened[0].opened.run_id
    (experiment,) = [
        p.parent for p in store.glob("*/meta.yaml") if "name: site-experiment" in p.read_text()
    ]
    assert (experiment / run_id / "metrics" / "loss").read_text().split()[1:] == ["1.5", "1"]
    assert not (tmp_path / "runs" / "mlruns").exists()
    (offline,) = wandb_dir.glob("wandb/offline-run-*")
    written = ({opened[1].opened.run_id}, [1])
    assert written_soon(lambda: wandb_steps(offline), written) and not (run_dir / "wandb").exists()
    assert f"using MLFLOW_TRACKING_URI={store.as_uri()} from the environment" in caplog.text
    assert "using WANDB_PROJECT=site-project from the environment" in caplog.text


@pytest.mark.parametrize(
    "configured, environment, used",
    [
        ("qgtrain", None, "qgtrain"),  # nothing set anywhere: the default
        ("qgtrain", "site", "site"),  # the config keeps the default: the site's variable
        ("mine", "site", "mine"),  # a value in the config wins
        ("mine", None, "mine"),
    ],
)
def test_a_config_value_wins_over_the_trackers_variable_and_the_default_does_not(
    configured, environment, used, caplog
):
    from qgtrain.config import LoggingConfig
    from qgtrain.training.trackers import tracker_setting

    environ = {"MLFLOW_EXPERIMENT_NAME": environment} if environment else {}
    with caplog.at_level("INFO", logger="qgtrain"):
        value = tracker_setting(
            LoggingConfig(mlflow_experiment=configured),
            "mlflow_experiment",
            "MLFLOW_EXPERIMENT_NAME",
            environ,
        )
    assert value == used
    if environment and used != environment:
        assert "the environment's MLFLOW_EXPERIMENT_NAME=site is not used" in caplog.text


def test_a_tracker_that_fails_warns_once_and_training_finishes(tmp_path):
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked" / "mlruns").write_text("a file where MLflow needs a folder")
    done = run(
        tmp_path,
        "train.max_steps=6",
        "logging.trackers=[mlflow]",
        f"logging.mlflow_uri=file://{tmp_path / 'locked' / 'mlruns'}",
    )
    assert done.returncode == 0, done.stderr
    assert (
        done.stderr.count("logging.trackers: mlflow") == 1
        and "training goes on without it" in done.stderr
    )
    assert records(tmp_path / "runs" / "tiny-gpt2")[-1]["step"] == 6


def test_an_unknown_tracker_is_refused_before_anything_runs(tmp_path):
    done = run(tmp_path, "logging.trackers=[wandb, comet]")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert (
        "logging.trackers: 'comet' is not a tracker qgtrain knows; choose from tensorboard, wandb, "
        "mlflow" in done.stderr
    )
    assert not (tmp_path / "runs").exists()


def test_a_tracker_whose_library_is_missing_is_refused_with_exit_2(monkeypatch):
    """check_installed runs on every rank before any step (run.py); a missing library is the user's
    to fix."""
    from qgtrain.foundation.errors import EXIT_USAGE, ConfigError
    from qgtrain.training import trackers

    monkeypatch.setitem(trackers.EXTRAS, "wandb", "wandb_is_not_installed_here")
    with pytest.raises(ConfigError) as refused:
        trackers.check_installed(("mlflow", "wandb"))
    assert refused.value.exit_code == EXIT_USAGE
    assert str(refused.value) == (
        "logging.trackers: wandb is not installed here; pip install 'qgtrain[wandb]' (or "
        "wandb_is_not_installed_here), or remove it from logging.trackers"
    )


def test_a_tracker_that_fails_while_logging_warns_once_and_is_dropped(caplog):
    from qgtrain.training.trackers import Opened, Tracker

    sent: list[int] = []

    def send(step: int, values: dict[str, float]) -> None:
        if step == 4:
            raise RuntimeError("the server went away")
        sent.append(step)

    tracker = Tracker("mlflow", Opened("run", send, lambda finished: None))
    with caplog.at_level("WARNING", logger="qgtrain"):
        for step in (2, 4, 6, 8):
            tracker.log({"step": step, "loss": 1.0})
        tracker.close(True)
    assert sent == [2] and tracker.broken
    assert (
        caplog.text.count(
            "logging.trackers: mlflow failed to log (RuntimeError: the server went away); "
            "training goes on without it"
        )
        == 1
    )
