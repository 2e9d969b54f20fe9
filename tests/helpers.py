"""What many tests need: the repository's root, reading a run's metrics and logs, and submitting to and
waiting on the Slurm test cluster."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
FINISHED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
# Two nodes of the test cluster, one rank each; the first two, so a test that cuts node2 cuts this job.
TWO_NODES = ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--nodelist=node[1-2]")


def records(run_dir: Path) -> list[dict]:
    """A run's metrics.jsonl, skipping a last line cut short by a kill."""
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def overlay(tmp_path: Path, max_steps: int, every_steps: int = 0,
            task_options: dict[str, object] | None = None) -> Path:
    """A small run under tmp_path: the built-in LM, or with task_options the task of a job file laid under
    it (its own options, its validations kept, early stopping off so the step count is fixed)."""
    path = tmp_path / "small.yaml"
    path.write_text((f"""
data: {{name: synthetic, seq_len: 32, synthetic_samples: 2048}}
model: {{layers: 1, hidden: 32, heads: 2}}
train: {{max_steps: {max_steps}, batch_size: 8, log_every: 50, eval_every: 0}}
""" if task_options is None else f"""
task: {{options: {json.dumps(task_options)}}}
train: {{max_steps: {max_steps}, log_every: 10}}
early_stopping: {{patience: 0}}
""") + f"""checkpoint: {{every_steps: {every_steps}}}
logging: {{tensorboard: false, runs_dir: {tmp_path / 'runs'}}}
""")
    (tmp_path / "jobs" / "out").mkdir(parents=True, exist_ok=True)
    return path


def sbatch(tmp_path: Path, *options: str, configs: list[Path]) -> str:
    result = subprocess.run(["sbatch", "--parsable", *options, str(ROOT / "train.slurm"), *map(str, configs)],
                            cwd=tmp_path, capture_output=True, text=True, check=True)
    return result.stdout.strip().split(";")[0]


def job(job_id: str) -> dict[str, str]:
    shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


def wait_until(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.5)


def wait_finished(job_id: str, timeout: float = 300) -> str:
    wait_until(lambda: job(job_id).get("JobState") in FINISHED, timeout, f"job {job_id} to finish")
    return job(job_id)["JobState"]


def logged_step(run_dir: Path) -> int:
    try:
        return max(json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    except (FileNotFoundError, ValueError):
        return 0


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step-{step}" / "model.pt", weights_only=True)


def rank_log(run_dir: Path, rank: int) -> str:
    """A rank's log so far ('' before the rank has opened it)."""
    try:
        return (run_dir / "logs" / f"rank_{rank}.log").read_text()
    except FileNotFoundError:
        return ""


