"""<run>/eval/results.jsonl (an export's <folder>/eval/results.jsonl): one JSON line per checkpoint
and task, appended by rank 0 as each task is scored, so a killed `qgtrain eval --all` loses at most
the task it was scoring. A line torn by the kill is dropped when read, and the next line starts on
its own. Each line says how it was scored (`scored_as`), so a line stands for its (step, task) only
while the tasks are asked the same way; and the console's table of them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..evals.items import read_tasks
from ..foundation.files import open_append


def scored_as(cfg: RunConfig) -> dict[str, str]:
    """Each task's name and what its figures depend on beside the checkpoint (its items, the
    generation settings, the weights scored, the precision), as a digest. A line kept from an
    earlier `qgtrain eval` stands for a (step, task) only under the same digest: changing
    train.eval_ema, a task's file or eval.stop scores the checkpoint again."""
    asked = (
        cfg.eval.max_new_tokens,
        cfg.eval.stop,
        "ema" if cfg.train.eval_ema else "model",
        cfg.train.precision,
    )
    return {
        task.name: hashlib.sha256(repr((task.kind, task.items, asked)).encode()).hexdigest()[:16]
        for task in read_tasks(cfg.eval.tasks, cfg.eval.max_items)
    }


@contextlib.contextmanager
def appending(results: Path) -> Iterator[Any]:
    results.parent.mkdir(mode=0o700, exist_ok=True)
    torn = results.is_file() and not results.read_bytes().endswith(b"\n") and results.stat().st_size
    with open_append(results) as out:
        if torn:  # a line cut by a kill: the next one starts on its own
            out.write("\n")
        yield out
        out.flush()


def kept(results: Path, scored_as: dict[str, str]) -> list[dict[str, Any]]:
    """The lines a run's results file holds of tasks scored as `scored_as` says (a line torn by a
    kill is dropped)."""
    if not results.is_file():
        return []
    kept = []
    for line in results.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if isinstance(row, dict) and "step" in row and isinstance(row.get("task"), str):
                if row.get("scored_as") == scored_as.get(row["task"]):
                    kept.append(row)
    return kept


def figures(metrics: dict[str, float | None]) -> str:
    return " ".join(f"{k} {'n/a' if v is None else f'{v:.4f}'}" for k, v in metrics.items())


def table(lines: list[dict[str, Any]]) -> str:
    """The results as the console shows them: one row per checkpoint and task."""
    rows = [("step", "task", "metrics")] + [
        (
            str(line.get("step", "-")),
            line["task"],
            figures({k: v for k, v in line.items() if k.startswith("eval_")}),
        )
        for line in lines
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}" for r in rows)
