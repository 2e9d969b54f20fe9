"""Start of `qgtrain train` up to the model: the process group, run directory and task phases of
GPT-2 124M's shape (12 x 768, 1024 tokens, byte vocabulary), one rank, one step, as each run's first
metrics record gives them (startup_s), for this tree and optionally another one (e.g. `git archive
<commit> | tar -x -C /tmp/base`), alternated. Usage: python -m bench.task_phase [--baseline
/tmp/base] [--rounds 5] [--device cpu|cuda] [--hidden 768 --layers 12 --heads 12 --seq 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("process group", "run directory", "task")


def start_of(tree: Path, run: Path, args: argparse.Namespace) -> dict[str, float]:
    sets = [
        "data.name=synthetic",
        f"data.seq_len={args.seq}",
        "data.synthetic_samples=64",
        f"model.hidden={args.hidden}",
        f"model.layers={args.layers}",
        f"model.heads={args.heads}",
        "train.batch_size=1",
        "train.max_steps=1",
        "train.eval_every=0",
        "checkpoint.every_steps=0",
        "train.eval_batches=1",
        "logging.tensorboard=false",
        "data.num_workers=0",
        f"train.device={args.device}",
    ]
    subprocess.run(
        [sys.executable, "-m", "qgtrain", "train", "--run-dir", str(run), "--set", *sets],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    startup: dict[str, float] = first["startup_s"]
    return {**startup, "group to task": sum(startup.get(name, 0.0) for name in PHASES)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", type=Path, help="another source tree to alternate with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    for name, default in (("hidden", 768), ("layers", 12), ("heads", 12), ("seq", 1024)):
        parser.add_argument(f"--{name}", type=int, default=default)
    args = parser.parse_args()
    trees = {"this tree": ROOT, **({"baseline": args.baseline} if args.baseline else {})}
    work = Path(tempfile.mkdtemp(prefix="qgtrain-task-phase-"))
    seen: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for index in range(args.rounds):  # ABBA: drift favours neither tree
        order = list(trees) if index % 2 == 0 else list(reversed(trees))
        for name in order:
            seen[name].append(
                start_of(trees[name], work / f"{name}-{index}".replace(" ", "-"), args)
            )
    shutil.rmtree(work, ignore_errors=True)  # a 124M model's final checkpoint per run
    for name, runs in seen.items():
        keys = [key for key in runs[0] if all(key in run for run in runs)]
        medians = ", ".join(
            f"{key} {statistics.median(r[key] for r in runs):.2f} s" for key in keys
        )
        print(f"{name} ({trees[name]}), medians of {len(runs)}: {medians}")


if __name__ == "__main__":
    main()
