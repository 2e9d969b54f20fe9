"""`qgtrain runs`: what every run under a folder is doing, read from its files alone (no torch, no
Slurm).

Every text it shows was written by whoever could write the run directory (on a shared filesystem:
anyone allowed to), so the table shows control characters escaped (`\x1b`, `\n`, `\u202e`:
foundation/terminal.py): a status.json cannot move the cursor, recolour or rewrite the terminal, or
add lines of its own. --json escapes them too.

BEST follows what the run's own early stopping and best checkpoint follow (its config.yaml's
early_stopping.metric, lowest or highest by early_stopping.mode), not always val_loss: a run that
follows val_accuracy is best where its accuracy is highest.

Status comes from what rank 0 recorded (status.json) checked against the run directory's lock: a run
that says "running" while nobody holds its lock was killed before it could say anything else
(interrupted), and resumes from its latest checkpoint when started again.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

from ..config import EarlyStoppingConfig
from ..foundation.errors import QgtrainError
from ..foundation.terminal import shown
from ..runs import rundir
from ..state import checkpoint
from ..training.goodput import Ledger
from ..training.metrics import read_metrics


@dataclass(frozen=True)
class RunSummary:
    name: str
    path: str
    status: str
    step: int | None
    epoch: int | None
    best_metric: str  # what the run's early stopping follows (early_stopping.metric)
    best: float | None  # its best value, lowest or highest by early_stopping.mode
    last_val_loss: float | None
    # the task's own metrics at the latest validation (val_accuracy, ...)
    last_val_metrics: dict[str, float]
    checkpoint: int | None
    restarts: int | None
    # each failed step: which rank, where, how, and what followed (retry, requeue, end)
    failures: list[str]
    job_id: str | None
    error: str | None
    swept: dict[str, str]  # the values its sweep gave it (empty outside a sweep)
    resumed: str | None = None  # where its latest start resumed: the step and the tier
    # where its time went, as shares of the whole (training/goodput.py)
    time: str | None = None


def find_runs(root: Path) -> list[Path]:
    """Run directories under root (root itself if it is one), in name order."""
    if not root.is_dir():
        raise QgtrainError(
            f"runs: {root} is not a directory; give the folder your runs are in "
            "(logging.runs_dir, 'runs' by default)"
        )
    if rundir.is_run_dir(root):
        return [root]
    return sorted(p for p in root.iterdir() if rundir.is_run_dir(p))


def summarize(run: Path, swept: dict[str, str] | None = None) -> RunSummary:
    status = rundir.read_status(run)
    run_dir = rundir.RunDir(run)
    records = read_metrics(run_dir.metrics) if run_dir.metrics.exists() else []
    trained = [r for r in records if "loss" in r]
    vals = [r["val_loss"] for r in records if r.get("val_loss") is not None]
    metric, mode = followed(run_dir.config)
    followed_values = [float(r[metric]) for r in records if _is_figure(r.get(metric))]
    evaluated = [r for r in records if any(k.startswith("val_") for k in r)]
    metrics = {
        k: v
        for k, v in (evaluated[-1] if evaluated else {}).items()
        if k.startswith("val_") and k != "val_loss" and isinstance(v, (int, float))
    }
    committed = checkpoint.list_committed(run_dir.checkpoints)
    run_id = rundir.read_run_id(run)
    ours = [c for c in committed if c.run_id == run_id]
    restart = status.get("restart")
    return RunSummary(
        name=run.name,
        path=str(run),
        status=_status(run, status),
        step=trained[-1]["step"] if trained else None,
        epoch=trained[-1]["epoch"] if trained else None,
        best_metric=metric,
        best=(max if mode == "max" else min)(followed_values) if followed_values else None,
        last_val_loss=vals[-1] if vals else None,
        last_val_metrics=metrics,
        checkpoint=ours[-1].step if ours else None,
        restarts=int(restart) if isinstance(restart, (int, float)) else None,
        failures=_failures(status),
        job_id=str(status["job_id"]) if status.get("job_id") else None,
        error=str(status["error"]) if status.get("error") else None,
        swept=swept or {},
        resumed=_resumed(status.get("resumed")),
        time=_time(status),
    )


def _time(status: dict[str, object]) -> str | None:
    ledger = Ledger.of(status)
    if not ledger.starts or ledger.total() <= 0:
        return None
    shares = ", ".join(
        f"{kind} {share:.0%}" for kind, share in ledger.shares().items() if share >= 0.0005
    )
    starts = f"{ledger.starts} start{'s' if ledger.starts > 1 else ''}"
    return f"{_duration(ledger.total())} in {starts}: {shares}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    minutes = seconds / 60
    return f"{minutes:.0f} min" if minutes < 120 else f"{minutes / 60:.1f} h"


def _resumed(recorded: object) -> str | None:
    if not isinstance(recorded, dict) or not isinstance(recorded.get("step"), int):
        return None
    return f"step {recorded['step']} from the {shown(str(recorded.get('tier')))} tier"


def followed(config: Path) -> tuple[str, str]:
    """The metric the run's early stopping and best checkpoint follow, and whether lower or higher
    is better ("min", "max"), from the config it recorded; the defaults where it recorded none."""
    default = EarlyStoppingConfig()
    try:
        recorded = yaml.safe_load(config.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        recorded = None
    section: Any = recorded.get("early_stopping") if isinstance(recorded, dict) else None
    section = section if isinstance(section, dict) else {}
    metric, mode = section.get("metric"), section.get("mode")
    return (
        metric if isinstance(metric, str) and metric else default.metric,
        mode if mode in ("min", "max") else default.mode,
    )


def _is_figure(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _failures(status: dict[str, object]) -> list[str]:
    recorded = status.get("failures")
    described = []
    for failure in recorded if isinstance(recorded, list) else []:
        if isinstance(failure, dict):
            where = (
                f"rank {failure['rank']} on {failure['node']}: {failure['how']}"
                if "rank" in failure
                else f"exit {failure.get('exit_code')}"
            )
            described.append(f"{where} -> {_followed(str(failure.get('action', '?')))}")
    return described


def _followed(action: str) -> str:
    """recover's answer as a reader wants it: `retry node2` retried on a spare node, `retry node2
    1` on one node."""
    what, *rest = action.split()
    if what != "retry" or not rest:
        return action
    if len(rest) == 2:
        return f"retry on {rest[1]} node(s), without {rest[0]}"
    return f"retry on a spare node, without {rest[0]}"


def _status(run: Path, status: dict[str, object]) -> str:
    recorded = str(status.get("status", "unknown"))
    locked = rundir.is_locked(run)
    if recorded == "running":
        return "running" if locked in (True, None) else "interrupted"
    if recorded == "preempted":
        requeued = status.get("requeued")
        if requeued is None:
            return "preempted, requeue pending"
        return "preempted, requeued" if requeued is True else "stopped"
    return recorded


def as_json(rows: list[RunSummary]) -> str:
    return json.dumps([asdict(row) for row in rows], indent=1)


def as_table(rows: list[RunSummary]) -> str:
    def fmt(value: object) -> str:
        if value is None:
            return "-"
        return f"{value:.4f}" if isinstance(value, float) else shown(str(value))

    header = (
        "RUN",
        "STATUS",
        "STEP",
        "EPOCH",
        "BEST",
        "LAST VAL",
        "CHECKPOINT",
        "RESTARTS",
        "FAILURES",
        "JOB",
        "METRICS",
        "SWEPT",
    )

    def metrics(r: RunSummary) -> str:
        return " ".join(f"{fmt(k)} {fmt(v)}" for k, v in r.last_val_metrics.items()) or "-"

    def swept(r: RunSummary) -> str:
        return " ".join(f"{fmt(k)}={fmt(v)}" for k, v in r.swept.items()) or "-"

    cells = [header] + [
        (
            fmt(r.name),
            fmt(r.status),
            fmt(r.step),
            fmt(r.epoch),
            f"{fmt(r.best_metric)} {fmt(r.best)}" if r.best is not None else "-",
            fmt(r.last_val_loss),
            fmt(r.checkpoint),
            fmt(r.restarts),
            str(len(r.failures)),
            fmt(r.job_id),
            metrics(r),
            swept(r),
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells
    ]
    lines += [f"{fmt(r.name)}: {fmt(r.error)}" for r in rows if r.status == "failed" and r.error]
    lines += [f"{fmt(r.name)}: last resumed at {r.resumed}" for r in rows if r.resumed]
    lines += [f"{fmt(r.name)}: time {r.time}" for r in rows if r.time]
    lines += [
        f"{fmt(r.name)}: failed step {i}: {fmt(failure)}"
        for r in rows
        for i, failure in enumerate(r.failures, 1)
    ]
    return "\n".join(lines)
