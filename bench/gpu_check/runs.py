"""qgtrain's own training runs: trained straight through twice (async and blocking checkpoints),
SIGKILLed after a committed checkpoint and resumed, held against each other; exported; the
checkpoint's stall read from metrics.jsonl. Runs go through bench.gpu_check.runner with
deterministic algorithms (runner.py).

Equality: two uninterrupted runs under deterministic settings that agree bit for bit make
bit-for-bit the bar for the resumed one. Where they do not (a kernel without a deterministic
implementation warned: runner.py counts it), the resumed run must stay within their spread, and the
check says it was held to a tolerance, not equality.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path

from qgtrain.training.metrics import read_metrics

from . import procs
from .report import Report


@dataclass(frozen=True)
class Plan:
    """A small run: its settings, length, checkpoint interval and the step after which it is
    killed."""

    device: str
    sets: tuple[str, ...]
    max_steps: int
    every: int
    timeout_s: float

    @property
    def kill_after(self) -> int:
        return 2 * self.every + 2  # step-(2*every) is committed and training went on past it


GPU = Plan(
    "cuda",
    (
        "model.hidden=256",
        "model.layers=4",
        "model.heads=4",
        "data.seq_len=128",
        "train.batch_size=16",
    ),
    200,
    50,
    900,
)
CPU = Plan(
    "cpu",
    (
        "model.hidden=32",
        "model.layers=1",
        "model.heads=2",
        "data.seq_len=32",
        "train.batch_size=4",
        "data.synthetic_samples=1024",
    ),
    24,
    5,
    240,
)


def train_args(plan: Plan, run: Path, parallel: str, precision: str, *extra: str) -> list[str]:
    return [
        "train",
        "--config",
        str(procs.ROOT / "config.yaml"),
        "--run-dir",
        str(run),
        "--set",
        "data.name=synthetic",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=2",
        "logging.tensorboard=false",
        "optim.warmup_steps=4",
        "checkpoint.async_save=true",
        f"train.max_steps={plan.max_steps}",
        f"checkpoint.every_steps={plan.every}",
        f"train.device={plan.device}",
        f"train.parallel={parallel}",
        f"train.precision={precision}",
        f"data.cache_dir={run.parent / 'data'}",
        *plan.sets,
        *extra,
    ]


def runner(
    world: int,
    plan: Plan,
    run: Path,
    parallel: str,
    precision: str,
    *extra: str,
    quiet: str = "",
    deterministic: bool = True,
) -> list[str]:
    return procs.torchrun(
        world,
        "bench.gpu_check.runner",
        *(["--deterministic"] if deterministic else []),
        *(["--quiet", quiet] if quiet else []),
        "--",
        *train_args(plan, run, parallel, precision, *extra),
    )


def losses(run: Path) -> dict[int, float]:
    path = run / "metrics.jsonl"
    return {
        r["step"]: r["loss"] for r in (read_metrics(path) if path.exists() else []) if "loss" in r
    }


def train(
    world: int, plan: Plan, run: Path, parallel: str, precision: str, *extra: str
) -> procs.Finished:
    return procs.run(
        runner(world, plan, run, parallel, precision, *extra),
        run.parent / f"{run.name}.log",
        plan.timeout_s,
        procs.DETERMINISTIC_ENV,
    )


def killed_and_resumed(
    world: int, plan: Plan, run: Path, parallel: str, precision: str
) -> procs.Finished:
    """SIGKILL every rank once a checkpoint is committed and training has gone past it; then
    resume."""
    log = run.parent / f"{run.name}.log"
    committed = run / "checkpoints" / f"step-{2 * plan.every}" / "manifest.json"
    proc = procs.start(runner(world, plan, run, parallel, precision), log, procs.DETERMINISTIC_ENV)
    killed = procs.wait(
        proc,
        log,
        plan.timeout_s,
        until=lambda: committed.exists() and max(losses(run), default=0) > plan.kill_after,
    )
    if killed.code != -9:
        return procs.Finished(
            killed.code,
            killed.seconds,
            log,
            "" if killed.code is None else f"ended (exit {killed.code}) before it could be killed",
        )
    return train(world, plan, run, parallel, precision)


def spread_and_worst(
    a: dict[int, float], b: dict[int, float], resumed: dict[int, float]
) -> tuple[float, float]:
    """The largest difference between the two uninterrupted runs, and between the first and the
    resumed."""
    spread = max((abs(a[s] - b.get(s, float("inf"))) for s in a), default=float("inf"))
    worst = max((abs(a[s] - resumed.get(s, float("inf"))) for s in a), default=float("inf"))
    return spread, worst


def judge_resume(report: Report, name: str, spread: float, worst: float) -> None:
    if spread == 0:
        report.check(
            worst == 0,
            f"{name}: resumed run equals an uninterrupted one bit for bit",
            f"largest difference {worst:.3g}",
            "deterministic settings; two uninterrupted runs equal",
        )
    else:
        report.check(
            worst <= 2 * spread,
            f"{name}: resumed run within two uninterrupted runs' spread",
            f"largest difference {worst:.3g}, spread {spread:.3g}",
            "tolerance, not equality: the uninterrupted runs differ (runner.py lists the kernels)",
        )


def checkpoint_stall(records: list[dict], every: int, last: int) -> tuple[float, float] | None:
    """(median extra seconds of a step followed by a checkpoint, median seconds of an ordinary
    step), from the wall time of each logged step: the checkpoint of step N is taken between N's
    record and N+1's."""
    times = {r["step"]: r["time"] for r in records if "loss" in r and "time" in r}
    gaps = {s: times[s + 1] - times[s] for s in times if s + 1 in times and s > 3}
    saved = [gaps[s] for s in gaps if s % every == 0 and s < last]
    plain = [gaps[s] for s in gaps if s % every not in (0, 1)]
    if not saved or not plain:
        return None
    typical = statistics.median(plain)
    return statistics.median(saved) - typical, typical


def judge_stall(report: Report, name: str, async_run: Path, blocking_run: Path, plan: Plan) -> None:
    found = [
        checkpoint_stall(read_metrics(run / "metrics.jsonl"), plan.every, plan.max_steps)
        if (run / "metrics.jsonl").exists()
        else None
        for run in (async_run, blocking_run)
    ]
    if found[0] is None or found[1] is None:
        report.check(
            False, f"{name}: async checkpoint stall", "", "no step timings around checkpoints"
        )
        return
    (stall, typical), (blocking, _) = found[0], found[1]
    report.check(
        stall <= 0.5 * blocking or stall <= 2 * typical,
        f"{name}: async checkpoint stall",
        f"{stall:.3f} s (blocking save {blocking:.3f} s, a step {typical:.3f} s)",
        "goal: under half a blocking save's, or under two steps",
    )
