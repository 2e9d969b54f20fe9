"""Jobs as users run them, on the Slurm test cluster: the code they submitted, whatever they edit
while the job waits or is requeued, and stages that follow each other (`qgtrain submit --then`).
Runs against: the cluster of tests/cluster (Slurm 22.05, no accounting), `qgtrain submit` as a
subprocess from a user's folder (tmp_path) holding the task module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers import (
    ROOT,
    checkpoint_state,
    cli,
    job,
    logged_step,
    overlay,
    rank_log,
    wait_finished,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]

ONE_RANK = ["slurm.nodes=1", "slurm.tasks_per_node=1", "slurm.cpus_per_task=1", "slurm.time=10"]
MY_TASK = '''"""A user's task module, in the folder jobs are submitted from."""
import logging
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import qgtrain


class Points(Dataset):
    def __init__(self, size, seed):
        self.size, self.seed = size, seed

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        x = torch.randn(8, generator=torch.Generator().manual_seed(self.seed * 7919 + i))
        return {"x": x, "label": (x[:3].sum() > 0).long()}


def paced(cfg):
    logging.getLogger("qgtrain").info("my_task: the code as submitted")

    def loss(model, batch):
        time.sleep(0.05)  # a step is a sleep, sparing the CPUs
        return F.cross_entropy(model(batch["x"]), batch["label"])

    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    return qgtrain.Task(model=model, train=Points(512, 1), val=Points(64, 2), loss=loss)


def fails(cfg):
    task = paced(cfg)

    def loss(model, batch):
        raise ValueError("my_task fails at step 1")

    task.loss = loss
    return task
'''


def user_folder(tmp_path: Path, factory: str, max_steps: int) -> list[str]:
    """The user's task module and config in tmp_path; returns the --config options."""
    (tmp_path / "my_task.py").write_text(MY_TASK)
    (tmp_path / "jobs" / "out").mkdir(parents=True)
    (tmp_path / "task.yaml").write_text(
        f"task: {{factory: '{factory}'}}\n"
        f"train: {{run_name: mine, max_steps: {max_steps}, log_every: 10, eval_every: 0, "
        "cpu_threads: 1}\nearly_stopping: {patience: 0}\ncheckpoint: {every_steps: 0}\n"
        f"logging: {{tensorboard: false, runs_dir: {tmp_path / 'runs'}}}\n"
    )
    configs = [ROOT / "config.yaml", ROOT / "jobs" / "cpu.yaml", tmp_path / "task.yaml"]
    return [arg for c in configs for arg in ("--config", str(c))]


READS_DATA = """

def reads_data(cfg):
    events = open("data/events.txt").read().split()  # relative to the folder submitted from
    logging.getLogger("qgtrain").info(f"my_task: read {len(events)} events from data/events.txt")
    return paced(cfg)
"""


def test_submitted_from_a_users_folder_by_the_venvs_qgtrain_the_job_runs_that_python_there(
    tmp_path,
):
    """No venv activated and a node `python3` without torch (a shim first on PATH): the job runs
    the interpreter that submitted it, in the folder it was submitted from, so the task reads its
    data by a relative path."""
    args = user_folder(tmp_path, "my_task:reads_data", 3)
    (tmp_path / "my_task.py").write_text(MY_TASK + READS_DATA)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "events.txt").write_text("1.5 2.5 3.5\n")
    shim = tmp_path / "shim"
    shim.mkdir()
    (shim / "python3").write_text('#!/bin/sh\necho "no torch" >&2\nexit 1\n')
    (shim / "python3").chmod(0o755)
    left_out = ("QGTRAIN_PYTHON", "PYTHONPATH", "VIRTUAL_ENV")  # conftest sets QGTRAIN_PYTHON
    env = {k: v for k, v in os.environ.items() if k not in left_out}
    env["PATH"] = f"{shim}:/usr/local/bin:/usr/bin:/bin"  # sbatch, not the venv's bin
    result = subprocess.run(
        [str(Path(sys.executable).parent / "qgtrain"), "submit", *args, "--set", *ONE_RANK],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    job_id = submitted(result)
    assert wait_finished(job_id, timeout=120) == "COMPLETED"
    run = tmp_path / "runs" / "mine"
    assert "my_task: read 3 events from data/events.txt" in rank_log(run, 0)
    assert logged_step(run) == 3
    output = (tmp_path / "jobs" / "out" / f"qgtrain-cpu-{job_id}.out").read_text()
    assert "no torch" not in output


def runs_table(tmp_path: Path) -> str:
    return subprocess.run(
        [sys.executable, "-m", "qgtrain", "runs", str(tmp_path / "runs")],
        capture_output=True,
        text=True,
    ).stdout


def submitted(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    return result.stdout.split("submitted ")[1].split("job ")[1].split(";")[0].split()[0]


def test_a_job_broken_after_submit_and_requeued_mid_run_completes_with_the_submitted_code(tmp_path):
    args = user_folder(tmp_path, "my_task:paced", 150)  # 7.5 s of steps, the signal after 2.5
    job_id = submitted(cli("submit", *args, "--set", *ONE_RANK, cwd=tmp_path))
    # edited while the job waits: the job must never import this
    (tmp_path / "my_task.py").write_text("def paced(cfg):\n    this is not Python\n")
    run = tmp_path / "runs" / "mine"
    wait_until(lambda: logged_step(run) >= 50, 120, "training to pass step 50")
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)  # a preemption's warning
    assert wait_finished(job_id, timeout=180) == "COMPLETED"
    assert job(job_id)["Restarts"] == "1" and logged_step(run) == 150
    log = rank_log(run, 0)
    assert log.count("my_task: the code as submitted") == 2, "both attempts built that task"
    stopped = int(log.split("stopping at step ")[1].split(" ")[0])
    assert f"resumed from {run / 'checkpoints' / f'step-{stopped}'}: step {stopped}" in log
    (code,) = (run / "code").iterdir()
    record = json.loads((code / "snapshot.json").read_text())
    assert record["hash"] == code.name and record["submit_dir"] == str(tmp_path)
    assert "logging.getLogger" in (code / "submit" / "my_task.py").read_text()
    assert "this is not Python" in (tmp_path / "my_task.py").read_text()


def test_a_chain_preempted_in_stage_1_runs_stage_2_once_from_stage_1s_weights_then_scores_it(
    tmp_path,
):
    # about 6 s of training on one rank: time to preempt it at step 100, and to see it resume
    first_steps = overlay(tmp_path, 800)
    # lr 0: the second stage's weights stay those it started from
    (tmp_path / "tune.yaml").write_text(
        f"model: {{pretrained: {tmp_path / 'runs' / 'cpu' / 'export'}}}\n"
        "optim: {lr: 0, min_lr: 0, warmup_steps: 0}\ntrain: {max_steps: 1, eval_every: 0}\n"
    )
    (tmp_path / "qa.jsonl").write_text('{"context": "def", "choices": [" f", " g"], "label": 0}\n')
    (tmp_path / "text.jsonl").write_text('{"text": "import os"}\n')
    (tmp_path / "score.yaml").write_text(  # an evaluation stage: only an eval: section
        f"eval: {{tasks: [{{name: qa, kind: multiple_choice, files: [{tmp_path / 'qa.jsonl'}]}}, "
        f"{{name: text, kind: perplexity, files: [{tmp_path / 'text.jsonl'}]}}]}}\n"
    )
    configs = [ROOT / "config.yaml", ROOT / "jobs" / "cpu.yaml", first_steps]
    result = cli(
        "submit",
        *[a for c in configs for a in ("--config", str(c))],
        "--then",
        "tune.yaml",
        "--then",
        "score.yaml",
        "--set",
        *ONE_RANK,
        "export.on_finish=true",
        cwd=tmp_path,
    )
    first_job = submitted(result)
    assert "submitted stage 1 of 3" in result.stdout, result.stdout
    run, chain = tmp_path / "runs" / "cpu", tmp_path / "runs" / "cpu" / "stages"
    wait_until(lambda: logged_step(run) >= 100, 120, "the first stage to pass step 100")
    subprocess.run(["scancel", "--signal=USR2", first_job], check=True)
    wait_until(lambda: "resumed from" in rank_log(run, 0), 120, "the first stage to resume")
    assert not (chain / "2.submitted").exists(), "the requeued stage had not finished"
    assert wait_finished(first_job, timeout=180) == "COMPLETED"
    assert job(first_job)["Restarts"] == "1"
    wait_until(lambda: (chain / "2.submitted").exists(), 30, "the second stage's submission")
    second_job = json.loads((chain / "2.submitted").read_text())["job_id"]
    assert wait_finished(second_job, timeout=180) == "COMPLETED"
    output = (tmp_path / "jobs" / "out" / f"qgtrain-cpu-{first_job}.out").read_text()
    assert output.count(f"qgtrain: submitted stage 2 as job {second_job}") == 1
    second = tmp_path / "runs" / "cpu-stage2"
    assert f"Slurm job {second_job} restart 0" in rank_log(second, 0)
    exported = load_file(run / "export" / "model.safetensors")
    started = checkpoint_state(second / "checkpoints" / "step-1")
    assert exported and all(
        torch.equal(t, started[f"model.{name}"]) for name, t in exported.items()
    ), "stage 2 began with stage 1's weights"
    wait_until(lambda: (chain / "3.submitted").exists(), 30, "the evaluation's submission")
    third_job = json.loads((chain / "3.submitted").read_text())["job_id"]
    assert wait_finished(third_job, timeout=180) == "COMPLETED"
    scored = (second / "eval" / "results.jsonl").read_text().splitlines()
    assert [(json.loads(x)["step"], json.loads(x)["task"]) for x in scored] == [
        (1, "qa"),
        (1, "text"),
    ]
    table = runs_table(tmp_path)
    assert f"chain cpu: stage 1/3 cpu: job {first_job}: finished" in table, table
    assert f"chain cpu: stage 2/3 cpu-stage2: job {second_job}: finished" in table, table
    assert f"chain cpu: stage 3/3 cpu-stage2: job {third_job}: 2 result(s)" in table, table


def test_a_failed_first_stage_never_submits_the_second_and_records_why(tmp_path):
    args = user_folder(tmp_path, "my_task:fails", 50)
    (tmp_path / "more.yaml").write_text("train: {max_steps: 60}\n")
    job_id = submitted(
        cli("submit", *args, "--then", "more.yaml", "--set", *ONE_RANK, cwd=tmp_path)
    )
    assert wait_finished(job_id, timeout=120) == "FAILED"
    chain = tmp_path / "runs" / "mine" / "stages"
    wait_until(lambda: (chain / "2.not-submitted").exists(), 30, "the reason to be recorded")
    reason = json.loads((chain / "2.not-submitted").read_text())["reason"]
    assert reason.startswith("stage 1 ended with exit 1 (failed: ")
    assert "my_task fails at step 1" in reason
    assert not (chain / "2.submitted").exists() and not (tmp_path / "runs" / "mine-stage2").exists()
    table = runs_table(tmp_path)
    assert "chain mine: stage 2/2 mine-stage2: not submitted: stage 1 ended with exit 1" in table, (
        table
    )
