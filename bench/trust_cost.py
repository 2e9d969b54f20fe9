"""What the checks that pin a run folder cost, at a start and at each save: the checks alone, timed
in one process on a run folder of a realistic size (checkpoints, a code snapshot, a compile cache
of inductor's shape, submitit's files).

  walk before    rundir.require_safe's walk as it was: the top, slurm/, stages/, code/
  walk now       the same walk with compile-cache/ and submitit/ (links must stay inside)
  folders above  trust.open_above: ssh's rule for the folders up to /
  require_safe   all of a start's check (pin, folders above, walk)
  pin check      Pinned.check: one stat of the run folder, compared (each save does it twice)
  save check     Checkpointer._still_pinned: rank 0's check and its broadcast (1-rank gloo group)
  cache claim    compile_cache's pin check and record read and rewritten (once per start)

Each is the median over `--repeats` interleaved calls (bench.common.alternate). Usage: python -m
bench.trust_cost [--repeats 200] [--cache-files 500] [--checkpoints 10]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
from pathlib import Path
from types import SimpleNamespace

from bench.common import alternate


def make_run(run: Path, checkpoints: int, cache_files: int, code_files: int) -> None:
    """A run folder as a long compiled run leaves it."""
    for name in ("logs", "slurm", "submitit", "code/0123456789abcdef/submit"):
        (run / name).mkdir(parents=True)
    (run / "run.json").write_text('{"run_id": "bench"}')
    for name in ("config.yaml", "metrics.jsonl", "status.json", "logs/rank_0.log"):
        (run / name).write_text("x\n")
    (run / "slurm" / "job.sbatch").write_text("#!/bin/sh\n")
    for step in range(1, checkpoints + 1):
        folder = run / "checkpoints" / f"step-{step * 100}"
        folder.mkdir(parents=True)
        for name in ("model.pt", "optim.pt", "rank-0.pt", "config.yaml", "manifest.json"):
            (folder / name).write_bytes(b"\0" * 64)
    for index in range(code_files):
        (run / "code" / "0123456789abcdef" / "submit" / f"module_{index}.py").write_text("")
    for index in range(cache_files):  # inductor's layout: <two letters>/<hash>.py and friends
        folder = run / "compile-cache" / "rank-0" / f"{index % 64:02x}"
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"c{index:05d}.py").write_text("")
    for index in range(4):
        (run / "submitit" / f"{index}_submitted.pkl").write_bytes(b"\0")
        (run / "submitit" / f"{index}_0_log.out").write_text("")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--cache-files", type=int, default=500)
    parser.add_argument("--checkpoints", type=int, default=10)
    parser.add_argument("--code-files", type=int, default=250)
    args = parser.parse_args()
    import torch.distributed as dist

    from qgtrain.foundation.pinned import Pinned
    from qgtrain.foundation.trust import open_above
    from qgtrain.runs import access, rundir
    from qgtrain.runtime import compile_cache
    from qgtrain.state.checkpointer import Checkpointer

    work = Path(tempfile.mkdtemp(prefix="qgtrain-trust-cost-"))
    run = work / "runs" / "demo"
    make_run(run, args.checkpoints, args.cache_files, args.code_files)
    files = sum(len(names) for _, _, names in os.walk(run))
    r = rundir.RunDir(run)
    pin = Pinned.now(run)
    mine = compile_cache.record(pin, "bench")
    folder = r.compile_cache / "rank-0"
    folder.with_name("rank-0.json").write_text(json.dumps(mine))  # made in this folder
    dist.init_process_group("gloo", init_method=f"file://{work}/group", rank=0, world_size=1)
    saver = Checkpointer.__new__(Checkpointer)  # only what _still_pinned reads
    saver.pin, saver.env = pin, SimpleNamespace(is_main=True)
    saver.group = dist.new_group(backend="gloo")

    def walk_before() -> None:
        walked = (r.slurm, r.stages, r.code)
        assert access.problem(run, walked, (r.slurm, r.stages, r.code / "jobs")) is None

    def walk_now() -> None:
        code = (r.compile_cache, r.submitit)
        walked = (r.slurm, r.stages, r.code, *code)
        assert access.problem(run, walked, (r.slurm, r.stages, r.code / "jobs"), code) is None

    def cache_claim() -> None:
        pin.check()
        compile_cache.bind(folder, mine)

    assert len(list(folder.rglob("*.py"))) == args.cache_files
    times = alternate(
        {
            "walk before": walk_before,
            "walk now": walk_now,
            "folders above": lambda: open_above(run),
            "require_safe": lambda: rundir.require_safe(run),
            "pin check": pin.check,
            "save check": saver._still_pinned,
            "cache claim": cache_claim,
        },
        args.repeats,
        warmup=3,
    )
    assert len(list(folder.rglob("*.py"))) == args.cache_files, "the cache was kept"
    dist.destroy_process_group()
    shutil.rmtree(work, ignore_errors=True)
    print(
        f"run folder of {files} files: {args.checkpoints} checkpoints, a {args.cache_files}-file "
        f"compile cache, a {args.code_files}-file code snapshot; median of {args.repeats}"
    )
    for name, values in times.items():
        print(f"  {name:<14} {statistics.median(values) * 1e3:8.3f} ms")


if __name__ == "__main__":
    main()
