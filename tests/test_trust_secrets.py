"""What qgtrain publishes: no tracker credential in its console, logs, run files or exported folder,
no credential accepted into a config, no exported folder that says where the user's machines are,
run directories private unless shared, and `qgtrain runs` showing other users' files without letting
them drive the terminal. Runs against: real `qgtrain` processes (train with real W&B offline and
MLflow stores, export, runs), a real MLflow HTTP client failing on a closed port, and the real
filesystem's modes."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from tests.helpers import TINY, cli
from tests.ranks import ROOT

PASSWORD = "s3cret-Pa55word"
API_KEY = "0123456789abcdef0123456789abcdef01234567"
# slurm.account, logging.wandb_project: about the user's site
MARKERS = ("acct-marker-7", "project-marker-7")


@pytest.fixture
def umask_022():
    """The umask most clusters give their users, under which a folder is world-readable unless made
    otherwise; the CLI processes a test starts inherit it."""
    before = os.umask(0o022)
    yield
    os.umask(before)


def every_file(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_tracker_credential_reaches_no_console_log_run_file_or_export(tmp_path):
    """MLflow reads a password in MLFLOW_TRACKING_URI itself: qgtrain uses the URI but shows it
    masked; WANDB_API_KEY is never shown. The exported model card and qgtrain_model.json, made to be
    published, keep the model's config but not the sections about the user's site (logging, slurm,
    export)."""
    store = tmp_path / "mlstore"
    uri = f"file://alice:{PASSWORD}@localhost{store}"
    run_dir = tmp_path / "runs" / "run"
    done = cli(
        "train",
        "--config",
        str(ROOT / "config.yaml"),
        "--run-dir",
        str(run_dir),
        "--set",
        *TINY,
        "train.max_steps=2",
        "logging.trackers=[wandb, mlflow]",
        f"logging.wandb_project={MARKERS[1]}",
        f"slurm.account={MARKERS[0]}",
        "export.on_finish=true",
        cwd=tmp_path,
        env={"MLFLOW_TRACKING_URI": uri, "WANDB_API_KEY": API_KEY, "WANDB_SILENT": "true"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    console = done.stdout + done.stderr
    for where, text in {"console": console.encode(), **every_file(run_dir)}.items():
        assert PASSWORD.encode() not in text and API_KEY.encode() not in text, where
    assert f"MLFLOW_TRACKING_URI=file://alice:***@localhost{store} from the environment" in console
    assert "logging to mlflow run" in console and list(store.glob("*/*/metrics/loss")), (
        "MLflow got the run"
    )
    exported = every_file(run_dir / "export")
    assert {"README.md", "qgtrain_model.json"} <= set(exported)
    for name, text in exported.items():
        assert not any(marker.encode() in text for marker in MARKERS), name
        assert str(tmp_path).encode() not in text, f"{name} names the user's folders"
    meta = json.loads(exported["qgtrain_model.json"])
    assert set(meta["config"]) == {
        "task",
        "model",
        "data",
        "optim",
        "train",
        "early_stopping",
        "checkpoint",
    }
    assert (
        meta["config"]["model"]["factory"] == "tests.factories:tiny"
        and meta["run"]["checkpoint"] == "step-2"
    )
    assert "factory: tests.factories:tiny" in exported["README.md"].decode()


def test_a_tracker_failure_quoting_its_uri_is_logged_masked(tmp_path, caplog, monkeypatch):
    """A library's error message may quote the URI it failed on, password included (MLflow's
    does)."""
    from qgtrain.config import LoggingConfig
    from qgtrain.training.trackers import open_trackers

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail at once on the closed port
    environ = {"MLFLOW_TRACKING_URI": f"http://alice:{PASSWORD}@127.0.0.1:9/"}
    with caplog.at_level("INFO", logger="qgtrain"):
        opened = open_trackers(
            LoggingConfig(trackers=("mlflow",)), tmp_path, "run", {}, environ=environ
        )
    assert opened == [] and "mlflow could not start" in caplog.text
    assert "http://alice:***@127.0.0.1:9/" in caplog.text and PASSWORD not in caplog.text


@pytest.mark.parametrize("how", ["--set", "file"])
@pytest.mark.parametrize(
    "uri, found",
    [
        (f"http://alice:{PASSWORD}@mlflow.example:5000", "a user name and password"),
        (f"https://mlflow.example/?token={PASSWORD}", "the query parameter 'token'"),
    ],
)
def test_a_credential_in_logging_mlflow_uri_is_refused_before_anything_is_written(
    tmp_path, how, uri, found
):
    """In the config it would be copied into config.yaml of the run, its checkpoints, slurm/ and
    sweep tasks, and the tracker's params: MLflow's own variables carry it instead."""
    run_dir = tmp_path / "run"
    given = ["--set", f"logging.mlflow_uri={uri}"]
    if how == "file":
        (tmp_path / "site.yaml").write_text(f"logging:\n  mlflow_uri: '{uri}'\n")
        given = ["--config", str(tmp_path / "site.yaml")]
    done = cli(
        "train",
        *given,
        "--run-dir",
        str(run_dir),
        "--set",
        *TINY,
        "train.max_steps=1",
        cwd=tmp_path,
        timeout=120,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr[-2000:]
    assert "logging.mlflow_uri" in done.stderr and found in done.stderr
    names = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")
    assert all(name in done.stderr for name in names)
    assert PASSWORD not in done.stdout + done.stderr
    assert not run_dir.exists()


@pytest.mark.parametrize("shared", [False, True])
def test_a_new_run_directory_is_private_unless_shared(tmp_path, umask_022, shared):
    """Under umask 022 every folder is world-readable; a run's config, logs and weights are not for
    everyone on the cluster. logging.shared opens it to the group to read (0750), never to
    writes."""
    run_dir = tmp_path / "runs" / "run"
    done = cli(
        "train",
        "--run-dir",
        str(run_dir),
        "--set",
        *TINY,
        "train.max_steps=1",
        "checkpoint.every_steps=1",
        f"logging.shared={str(shared).lower()}",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    mode = stat.S_IMODE(run_dir.stat().st_mode)
    assert mode == (0o750 if shared else 0o700), oct(mode)
    assert "open to other users" not in done.stderr


def test_an_existing_run_directory_keeps_its_mode_and_an_open_one_is_named(tmp_path, umask_022):
    """A folder made before (by the user, or an older qgtrain) is not changed behind the user's
    back."""
    from qgtrain.state.rundir import create

    made = tmp_path / "mine"
    made.mkdir()
    assert "open to other users (mode 0755)" in (create(made, shared=False) or "")
    assert create(made, shared=True) is None and stat.S_IMODE(made.stat().st_mode) == 0o755
    made.chmod(0o750)
    assert create(made, shared=False) is None and stat.S_IMODE(made.stat().st_mode) == 0o750
    assert create(tmp_path / "new" / "run", shared=False) is None
    assert stat.S_IMODE((tmp_path / "new" / "run").stat().st_mode) == 0o700


def test_runs_shows_control_characters_from_a_run_directory_escaped(tmp_path):
    """Anyone who can write a shared run directory writes what `qgtrain runs` shows: escape
    sequences that recolour, clear or retitle the terminal, and lines that pose as other runs, are
    shown as text."""
    run = tmp_path / "runs" / "evil"
    run.mkdir(parents=True)
    (run / "run.json").write_text(json.dumps({"run_id": "abc"}))
    (run / "status.json").write_text(
        json.dumps(
            {
                "status": "failed",
                "error": "boom\x1b[2J\r\nother-run: finished\u202e",
                "job_id": "7\x1b]0;owned\x07",
                "failures": [
                    {"rank": 0, "node": "n1\x1b[31m", "how": "killed\x9b", "action": "end"}
                ],
            }
        )
    )
    table = cli("runs", str(tmp_path / "runs"), cwd=tmp_path)
    listed = cli("runs", str(tmp_path / "runs"), "--json", cwd=tmp_path)
    assert table.returncode == 0 and listed.returncode == 0, table.stderr + listed.stderr
    for shown in (table.stdout, listed.stdout):
        assert not any(
            ord(c) < 32 and c != "\n" or 0x7F <= ord(c) < 0xA0 or c == "\u202e" for c in shown
        ), shown
    assert "evil: boom\\x1b[2J\\r\\nother-run: finished\\u202e" in table.stdout
    assert "7\\x1b]0;owned\\x07" in table.stdout and "n1\\x1b[31m" in table.stdout
    assert json.loads(listed.stdout)[0]["error"] == "boom\x1b[2J\r\nother-run: finished\u202e"
