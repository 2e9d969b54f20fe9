"""The main job end to end, as a user runs it: `python -m qgtrain train` and torchrun, real
processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, cli, records

# torchrun as a user types it, two ranks on this machine.
TORCHRUN_TWO_RANKS = (
    sys.executable,
    "-m",
    "torch.distributed.run",
    "--nproc_per_node=2",
    "-m",
    "qgtrain",
)


def qgtrain(
    tmp_path: Path, *args: str, launcher: tuple[str, ...] = (), timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return cli(
        "train",
        "--config",
        str(ROOT / "config.yaml"),
        "--set",
        f"data.cache_dir={tmp_path / 'data'}",
        f"logging.runs_dir={tmp_path / 'runs'}",
        *args,
        cwd=tmp_path,
        timeout=timeout,
        launcher=launcher,
    )


@pytest.mark.slow
def test_main_job_on_a_short_setting_learns_and_fills_its_run_directory(tmp_path):
    # the main job's model on half its batch: the same steps for half the CPU
    result = qgtrain(
        tmp_path,
        "train.max_steps=80",
        "train.batch_size=8",
        "train.eval_every=20",
        "train.log_every=10",
        "data.corpus_mb=1",
        "checkpoint.every_steps=40",
    )
    assert result.returncode == 0, result.stderr
    run = tmp_path / "runs" / "tiny-gpt2"
    logged = records(run)
    losses = [r["loss"] for r in logged]
    vals = [r["val_loss"] for r in logged if "val_loss" in r]
    assert losses[-1] < losses[0] - 1.0, losses
    assert len(vals) == 4 and vals[-1] < vals[0] - 0.2 and logged[-1]["test_loss"] > 0
    assert [r["step"] for r in logged] == sorted({r["step"] for r in logged}), (
        "one record per logged step"
    )
    assert {"step", "epoch", "loss", "lr"} <= set(logged[0])
    assert repr(logged[0]["loss"]) in (run / "metrics.jsonl").read_text(), (
        "losses are written at full precision"
    )
    for path in (
        "config.yaml",
        "run.json",
        "logs/rank_0.log",
        "checkpoints/step-40/manifest.json",
        "checkpoints/step-80/manifest.json",
    ):
        assert (run / path).is_file(), path
    assert any((run / "tb").glob("events.out.tfevents.*"))
    assert "[rank 0]" in (run / "logs" / "rank_0.log").read_text()

    again = qgtrain(
        tmp_path,
        "train.max_steps=80",
        "train.batch_size=8",
        "train.eval_every=20",
        "data.corpus_mb=1",
    )
    assert again.returncode == 0 and "this run already ended at step 80 (finished)" in again.stderr
    assert len(records(run)) == len(logged)


@pytest.mark.slow
def test_torchrun_runs_the_same_config_as_two_ranks(tmp_path):
    result = qgtrain(
        tmp_path,
        "train.max_steps=20",
        "train.batch_size=8",
        "train.eval_every=10",
        "data.corpus_mb=0.3",
        launcher=TORCHRUN_TWO_RANKS,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "tiny-gpt2"
    assert "2 rank(s) on 1 node(s)" in (run / "logs" / "rank_0.log").read_text()
    assert "[rank 1]" in (run / "logs" / "rank_1.log").read_text()
    assert records(run)[-1]["step"] == 20
    # A stop at a checkpoint under torchrun: every rank exits 75, torchrun's agent reports it and
    # exits 1 (what the README's table of exit codes says); status.json tells the outcome.
    stopped = qgtrain(
        tmp_path,
        "train.max_steps=100000",
        "train.max_time=1s",
        "train.batch_size=8",
        "data.corpus_mb=0.3",
        launcher=TORCHRUN_TWO_RANKS,
    )
    assert stopped.returncode == 1 and "exitcode  : 75" in stopped.stderr, stopped.stderr[-3000:]
    assert json.loads((run / "status.json").read_text())["status"] == "preempted"
    # the flags of the first agreement (step 21) reach the host at the read two agreements later
    assert re.search(
        r"stopping at step 2[1-3] on the time limit: checkpoint saved",
        (run / "logs" / "rank_0.log").read_text(),
    )
