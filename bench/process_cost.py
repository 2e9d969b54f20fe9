"""Whole `qgtrain` processes, start to exit: wall and CPU seconds of a 5-step `qgtrain train` of a
small model on one CPU rank and of `qgtrain export` of its run, for this tree and another one (e.g.
`git archive <commit> | tar -x -C /tmp/base`), alternated. What every rank of every start, export
and evaluation pays before and after its work: imports, the collector (interface/collector.py),
the interpreter's exit. Usage: python -m bench.process_cost --baseline /tmp/base [--rounds 6]
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = [
    "data.name=synthetic",
    "data.seq_len=32",
    "data.synthetic_samples=256",
    "model.hidden=32",
    "model.layers=2",
    "model.heads=2",
    "train.batch_size=8",
    "train.max_steps=5",
    "train.eval_every=0",
    "train.eval_batches=1",
    "logging.tensorboard=false",
    "data.num_workers=0",
    "train.device=cpu",
]


def timed(tree: Path, args: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one `qgtrain` process run from `tree`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "qgtrain", *args],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def one_round(tree: Path, work: Path) -> dict[str, float]:
    run, out = work / "run", work / "export"
    train = timed(tree, ["train", "--run-dir", str(run), "--set", *SMALL])
    export = timed(tree, ["export", str(run), "--out", str(out)])
    shutil.rmtree(work)
    return {
        "train wall": train[0],
        "train cpu": train[1],
        "export wall": export[0],
        "export cpu": export[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", type=Path, required=True, help="a source tree to compare")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    trees = {"this tree": ROOT, "baseline": args.baseline}
    work = Path(tempfile.mkdtemp(prefix="qgtrain-process-cost-"))
    seen: dict[str, list[dict[str, float]]] = {name: [] for name in trees}
    for index in range(args.rounds):  # ABBA: drift favours neither tree
        for name in list(trees) if index % 2 == 0 else list(reversed(trees)):
            seen[name].append(one_round(trees[name], work / f"{index}-{name.replace(' ', '-')}"))
    shutil.rmtree(work, ignore_errors=True)
    medians = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in seen.items()
    }
    for key in medians["this tree"]:
        ours, theirs = medians["this tree"][key], medians["baseline"][key]
        print(f"{key}: this tree {ours:.2f} s, baseline {theirs:.2f} s, ratio {ours / theirs:.3f}")
    print(f"medians of {args.rounds} alternated rounds; baseline {args.baseline}")


if __name__ == "__main__":
    main()
