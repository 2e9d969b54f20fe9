"""A failed step's record in status.json: which rank failed first, where, how, its last log line
and the note it left; the failures per node a requeue's exclusions count; and the step's NCCL Flight
Recorder dumps kept apart, one folder per failure. Written by `qgtrain recover` (recovery.py); no
torch."""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..runs import rundir
from . import aborts
from .srun_log import TaskFailure


def per_node(failures: list[dict[str, Any]]) -> dict[str, int]:
    """The run's failures on each node: where its first failing task ran, or srun said it failed."""
    counts: dict[str, int] = {}
    for entry in failures:
        lost = entry.get("lost")
        nodes = set(lost) if isinstance(lost, list) else set()
        if entry.get("node"):
            nodes.add(entry["node"])
        for node in nodes:
            counts[node] = counts.get(node, 0) + 1
    return counts


def keep_dumps(run: rundir.RunDir, failure: int) -> tuple[tuple[int, ...], Path]:
    """Move this step's Flight Recorder dumps into nccl/failure-<failure>/ (one failure's dumps are
    what `torchfrtrace` reads, and the next failure's are then told apart); their ranks, and where
    they are."""
    prefix = run.nccl_dumps
    try:
        names = [p.name for p in prefix.parent.iterdir() if p.is_file()]
    except OSError:
        return (), prefix.parent
    kept = prefix.parent / f"failure-{failure}"
    moved = []
    for rank in aborts.dumped_ranks(names, prefix.name):
        try:
            kept.mkdir(exist_ok=True)
            (prefix.parent / f"{prefix.name}{rank}").rename(kept / f"{prefix.name}{rank}")
        except OSError:
            continue
        moved.append(rank)
    return tuple(moved), kept if moved else prefix.parent


def record(
    run: rundir.RunDir,
    failure: TaskFailure | None,
    notes: dict[int, dict[str, Any]],
    exit_code: int,
    attempt: int,
    restart: int,
) -> dict[str, Any]:
    """Which rank failed first, on which host, with what, and the last line of its log."""
    record: dict[str, Any] = {
        "time": time.time(),
        "restart": restart,
        "attempt": attempt,
        "exit_code": exit_code,
    }
    if failure is not None:
        record.update(asdict(failure), last_line=_last_line(run.rank_log(failure.rank)))
    if notes:
        rank = min(notes)
        record.update(note_rank=rank, note=notes[rank]["message"])
    return record


def _last_line(path: Path) -> str | None:
    try:
        with open(path, "rb") as log:
            log.seek(0, 2)
            log.seek(max(log.tell() - 4096, 0))
            lines = log.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return None
    return lines[-1][:300] if lines else None
