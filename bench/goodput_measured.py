"""Goodput measured on the Slurm test cluster under injected failures, beside what bench.goodput's
model predicts from the same run's costs.

A two-node job (tests/tasks.py's slow_evaluation: points whose steps take --step-s, a sleep, so
the run's pace holds on a busy machine) trains for --steps steps, saving every --every steps,
with slurm.step_retries high enough that every failure is retried in its allocation.
While it trains, a rank is SIGKILLed at random times (exponential gaps, mean --mtbf-s), as a machine
would fail. Its ledger (status.json `time`) says where the allocation's time went; goodput is the
share that trained steps that count.

The model is bench.goodput's first-order one: the share wasted is C / t + (R + t / 2) / M, with C a
save's stall, t the interval between saves, R what a failure costs besides steps (the start after
it, the batch script's back-off) and M the mean time between failures, plus R / T for the first
start, which the model does not count. C, t, R and M are this run's (its ledger, its log, the
failures it recorded; R the same for every failure). What the model predicts on its own is the
work lost per failure, half an interval: the measured share of recomputed steps tests it, and so
does the goodput (torchft reported 82.3% measured against 83.3% predicted). Each failure loses a
uniform part of an interval, so a run with ten failures a minute apart scatters by a few percent
whatever the model: how far chance alone moves the goodput (one standard deviation) is printed
beside it.

Figures: docs/performance.md, "The model held to measured runs". Runs on the Slurm test cluster
(root), joined as a test run joins it (tests/conftest.py): started when no one uses it, and a test
run waits until this one is done.

Usage: python -m bench.goodput_measured [--steps 10000] [--every 500] [--step-s 0.02]
[--mtbf-s 30] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.goodput import wasted
from tests.conftest import LAB, _join_cluster, _leave_cluster
from tests.helpers import kill_rank, logged_step, rank_log, wait_finished

ROOT = Path(__file__).resolve().parent.parent


def settings(folder: Path, steps: int, every: int, step_s: float) -> list[Path]:
    overlay = folder / "measured.yaml"
    overlay.write_text(
        f"task: {{factory: '{ROOT / 'tests' / 'tasks.py'}:slow_evaluation', "
        f"options: {{size: 4096, step_s: {step_s}, eval_batch_s: 0}}}}\n"
        f"train: {{max_steps: {steps}, batch_size: 8, log_every: 50, eval_every: 0}}\n"
        f"checkpoint: {{every_steps: {every}}}\n"
        f"logging: {{tensorboard: false, runs_dir: {folder / 'runs'}}}\n"
        "slurm: {nodes: 2, tasks_per_node: 1, cpus_per_task: 1, time: '30', step_retries: 10,"
        " output_dir: out}\n"
    )
    return [ROOT / "config.yaml", ROOT / "jobs" / "cpu.yaml", overlay]


def state(job_id: str) -> str:
    shown = subprocess.run(
        ["scontrol", "show", "job", job_id], capture_output=True, text=True
    ).stdout
    found = re.search(r"JobState=(\S+)", shown)
    return found.group(1) if found else "UNKNOWN"


def inject(job_id: str, run: Path, mtbf_s: float, chance: random.Random) -> int:
    """Kill a random rank at exponential gaps while the job runs; the kills made."""
    kills = 0
    while state(job_id) in ("PENDING", "CONFIGURING") or logged_step(run) == 0:
        time.sleep(0.5)
    while True:
        due = time.time() + chance.expovariate(1 / mtbf_s)
        while time.time() < due:
            if state(job_id) not in ("RUNNING", "COMPLETING"):
                return kills
            time.sleep(0.2)
        try:
            kill_rank(job_id, chance.choice((0, 1)))
            kills += 1
        except AssertionError:  # between steps: no training process to kill
            pass


def predicted(
    seconds: dict[str, float], steps: int, every: int, saves: int, failures: int
) -> dict[str, float]:
    """bench.goodput's model with this run's costs, and the first start (which the model does not
    count) as one more start like the others."""
    total = sum(seconds.values())
    interval = every * seconds["training"] / steps
    save_s = seconds["checkpoint"] / max(saves, 1)
    # what each failure, and the first start, cost besides steps: the start after it (imports,
    # rendezvous, restore), the batch script's back-off, the rest that is no step's
    start_s = (total - seconds["training"] - seconds["recomputed"] - seconds["checkpoint"]) / (
        failures + 1
    )
    mtbf = total / failures if failures else float("inf")
    return {
        "goodput": 1 - wasted(interval, save_s, start_s, mtbf) - start_s / total,
        # the work a failure loses is a uniform part of an interval: how far chance alone moves a
        # run's goodput (one standard deviation) with this many failures
        "spread": math.sqrt(failures) * interval / math.sqrt(12) / total,
        "recomputed": failures * interval / 2 / total,
        "interval_s": interval,
        "save_s": save_s,
        "start_s": start_s,
        "mtbf_s": mtbf,
        "total_s": total,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description="goodput measured under injected failures")
    parser.add_argument("--steps", type=int, default=10000)
    parser.add_argument("--every", type=int, default=500)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--mtbf-s", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ["SLURM_CONF"] = str(LAB / "slurm.conf")
    os.environ["QGTRAIN_PYTHON"] = sys.executable
    _join_cluster()
    try:
        return measure(args)
    finally:
        _leave_cluster()


def measure(args: argparse.Namespace) -> int:
    folder = Path(tempfile.mkdtemp(prefix="goodput-"))
    words = [
        w
        for c in settings(folder, args.steps, args.every, args.step_s)
        for w in ("--config", str(c))
    ]
    submitted = subprocess.run(
        [sys.executable, "-m", "qgtrain", "submit", *words],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    if submitted.returncode != 0:
        print(submitted.stderr, file=sys.stderr)
        return 1
    job_id = re.findall(r"job (\d+)", submitted.stdout)[0]
    run = folder / "runs" / "cpu"
    kills = inject(job_id, run, args.mtbf_s, random.Random(args.seed))
    ended = wait_finished(job_id, timeout=1800)
    status = json.loads((run / "status.json").read_text())
    seconds, failures = status["time"]["seconds"], len(status.get("failures", []))
    saves = rank_log(run, 0).count("saved checkpoint")
    starts = int(status["time"]["starts"])
    model = predicted(seconds, args.steps, args.every, saves, failures)
    measured = seconds["training"] / model["total_s"]
    print(
        f"job {job_id}: {ended}, {kills} kills, {failures} failures recorded, {starts} starts "
        f"that trained, {saves} saves"
    )
    print("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in seconds.items()))
    print(
        f"costs: save {model['save_s']:.2f} s every {model['interval_s']:.1f} s, train again "
        f"{model['start_s']:.1f} s, a failure every {model['mtbf_s']:.1f} s"
    )
    print(
        f"recomputed share: measured {seconds['recomputed'] / model['total_s']:.1%}, "
        f"model {model['recomputed']:.1%}"
    )
    print(
        f"goodput: measured {measured:.1%}, model {model['goodput']:.1%} "
        f"({abs(measured / model['goodput'] - 1):.1%} apart); chance alone: "
        f"+-{model['spread'] / model['goodput']:.1%}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
