"""`python -m bench.gpu_check`: the first thing to run on a machine with GPUs (see __init__.py)."""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from . import checks, procs, runs
from .report import Report

MODES = [("ddp", "bf16"), ("ddp", "fp16"), ("fsdp", "bf16")]


def trained(
    report: Report,
    world: int,
    plan: runs.Plan,
    parallel: str,
    precision: str,
    folder: Path,
    export: bool,
) -> None:
    """Straight through with async and with blocking checkpoints, and killed then resumed;
    compared."""
    name = f"{world} rank(s) {parallel} {precision}"
    tag = f"{world}-{parallel}-{precision}"
    a, b, killed = (folder / f"{tag}-{kind}" for kind in ("async", "blocking", "killed"))
    done = [
        runs.train(world, plan, a, parallel, precision),
        runs.train(world, plan, b, parallel, precision, "checkpoint.async_save=false"),
        runs.killed_and_resumed(world, plan, killed, parallel, precision),
    ]
    failed = [f.describe() for f in done if not f.ok]
    if not report.check(
        not failed,
        f"{name}: trains, and resumes after SIGKILL",
        f"{sum(f.ok for f in done)} of 3 runs",
        " | ".join(failed),
    ):
        return
    runs.judge_resume(
        report, name, *runs.spread_and_worst(runs.losses(a), runs.losses(b), runs.losses(killed))
    )
    runs.judge_stall(report, name, a, b, plan)
    logs = [
        (a / "logs" / f"rank_{rank}.log").read_text(errors="replace")
        if (a / "logs" / f"rank_{rank}.log").exists()
        else ""
        for rank in range(world)
    ]
    if plan.device == "cuda" and world > 1:
        report.check(
            all(f"device cuda:{rank}\n" in log for rank, log in enumerate(logs)),
            f"{name}: every rank trains on its own GPU",
            "",
            "device cuda:<local rank> in each log",
        )
    if plan.device == "cuda":
        report.check(
            (a / "nccl").is_dir() and "NCCL Flight Recorder" in logs[0],
            f"{name}: NCCL's Flight Recorder dumps into the run directory",
            "",
            str(a / "nccl"),
        )
    if export:
        out = procs.run(
            [
                sys.executable,
                "-m",
                "qgtrain",
                "export",
                str(killed),
                "--out",
                str(folder / f"export-{tag}"),
            ],
            folder / f"export-{tag}.log",
            600,
        )
        report.check(
            out.ok and (folder / f"export-{tag}").is_dir(),
            f"{name}: qgtrain export of the resumed run",
            "",
            "" if out.ok else out.describe(),
        )


def on_gpus(report: Report, count: int, folder: Path, speed_rounds: int, only: str) -> None:
    if only == "speed":
        checks.step_time(report, folder, speed_rounds)
        return
    if only == "resume":
        checks.no_host_sync(report, runs.GPU, folder)
        trained(report, 1, runs.GPU, "ddp", "bf16", folder / "w1", export=True)
        return
    checks.auto_precision(report)
    worlds = sorted({1, count})
    for world in worlds:
        checks.wrappers(report, world, "cuda", folder)
    checks.step_time(report, folder, speed_rounds)
    checks.no_host_sync(report, runs.GPU, folder)
    for world in worlds:
        for parallel, precision in MODES:
            if parallel == "fsdp" and world == 1:
                report.skip(
                    f"1 rank {parallel} {precision} through qgtrain",
                    "qgtrain wraps nothing on one rank; the probe shards 1 rank itself",
                )
                continue
            trained(
                report,
                world,
                runs.GPU,
                parallel,
                precision,
                folder / f"w{world}",
                export=(parallel, precision) == ("ddp", "bf16"),
            )


def dry_run(report: Report, folder: Path) -> None:
    """What a CPU can run of the same flow: gloo ranks, a tiny model."""
    for world in (1, 2):
        checks.wrappers(report, world, "cpu", folder)
    trained(report, 1, runs.CPU, "ddp", "fp32", folder, export=True)
    report.skip(
        "gpt2-124m batch 16 and 64: tokens/s, MFU, start and data wait against hand-written",
        "needs CUDA (bench/train_speed.py runs on a CPU "
        "alone: python -m bench.train_speed --preset tiny --world 1)",
    )
    report.skip("no host sync on non-logging steps", "needs CUDA (torch.cuda.set_sync_debug_mode)")
    report.skip("GPU memory per rank against expected shares", "needs CUDA")


def main() -> int:
    parser = argparse.ArgumentParser(
        description="qgtrain's GPU paths end to end, one summary table"
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the run folders (printed) for a look after"
    )
    parser.add_argument(
        "--speed-rounds",
        type=int,
        default=2,
        help="alternated rounds of qgtrain and the hand-written loop per gpt2-124m reading",
    )
    parser.add_argument(
        "--only-speed",
        action="store_true",
        help="only the gpt2-124m readings (batch 16 and 64), for a short lease of a GPU",
    )
    parser.add_argument(
        "--only-resume",
        action="store_true",
        help="only one GPU's ddp bf16 runs (async, blocking, SIGKILLed and resumed), the host-sync "
        "check and export, for a short lease of a GPU",
    )
    args = parser.parse_args()
    only = "speed" if args.only_speed else "resume" if args.only_resume else ""
    import torch

    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    device = torch.cuda.get_device_name(0) if cuda else "CPU (dry run)"
    report = Report(f"{count} x {device}" if cuda else device, torch.__version__)
    print(
        f"{report.device}; torch {torch.__version__}, CUDA {torch.version.cuda or 'none'}",
        flush=True,
    )
    folder = Path(tempfile.mkdtemp(prefix="qgtrain-gpu-check-"))
    for world in {1, count} if cuda else ():
        (folder / f"w{world}").mkdir()
    try:
        if cuda:
            on_gpus(report, count, folder, args.speed_rounds, only)
        else:
            dry_run(report, folder)
    finally:
        if args.keep or report.failed:
            print(f"runs kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"\n{report.table()}\n\n{report.summary()}")
    if not cuda:
        print(
            "no CUDA device here: the above is the CPU dry run of the orchestration; "
            "run this on a machine "
            "with GPUs",
            file=sys.stderr,
        )
        return 1 if report.failed else 2
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
