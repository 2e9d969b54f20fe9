"""A requeued job with model.compile: time to the first step of the second start against the first.

Each start gets an empty node-local inductor cache (TORCHINDUCTOR_CACHE_DIR in a fresh folder), as a
requeue on another node would, so only what qgtrain keeps in the run directory can help. One rank,
the small preset's GPT-2; the first start trains 5 steps, the second resumes and trains 5 more.

    .venv/bin/python -m bench.compile_restart [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start(run: Path, steps: int) -> float:
    """Seconds from process start to the end of the first step, as qgtrain reports it."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="inductor-")}
    subprocess.run(
        [
            sys.executable,
            "-m",
            "qgtrain",
            "train",
            "--run-dir",
            str(run),
            "--set",
            "data.name=synthetic",
            "data.seq_len=128",
            "model.layers=2",
            "model.hidden=128",
            "model.heads=4",
            "model.compile=true",
            "train.batch_size=8",
            f"train.max_steps={steps}",
            "train.eval_every=0",
            "train.log_every=1",
            "logging.tensorboard=false",
            "checkpoint.every_steps=0",
        ],
        cwd=run.parent,
        env=env,
        check=True,
        capture_output=True,
    )
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return sum(next(r for r in reversed(records) if "startup_s" in r)["startup_s"].values())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    firsts, seconds = [], []
    for _ in range(args.repeats):
        run = Path(tempfile.mkdtemp(prefix="qgtrain-compile-")) / "run"
        firsts.append(start(run, 5))
        seconds.append(start(run, 10))
        print(f"first start {firsts[-1]:.2f} s, second start {seconds[-1]:.2f} s", flush=True)
    first, second = statistics.median(firsts), statistics.median(seconds)
    print(
        f"time to the first step with model.compile: first start {first:.2f} s, requeued start "
        f"{second:.2f} s, ratio {second / first:.2f} (goal <= 0.5; medians of {args.repeats})"
    )


if __name__ == "__main__":
    main()
