"""<run>/eval/results.jsonl (an export's <folder>/eval/results.jsonl): one JSON line per checkpoint
and task (or split: val, test, eval_figures.py), appended by rank 0 as each is scored, so a killed
`qgtrain eval --all` loses at most the one it was scoring. A line torn by the kill is dropped when
read, and the next line starts on its own. Each line says how it was scored (`scored_as`), so a
line stands for its (step, task) only while the tasks are asked the same way; and the console's
table of them. The file is read and
appended to only as a plain file, never through a link (eval_out.py checks its folder).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..evals.items import read_tasks
from ..foundation.errors import QgtrainError
from ..foundation.files import open_append
from ..foundation.terminal import shown

FIGURES = ("eval_", "val_", "test_")  # what a line's metrics are named: eval.tasks', the splits'


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
    before = _read(results)
    with open_append(results) as out:
        if before and not before.endswith("\n"):  # a line cut by a kill: the next starts anew
            out.write("\n")
        yield out
        out.flush()


def kept(results: Path, scored_as: dict[str, str], source: str | None) -> list[dict[str, Any]]:
    """The lines a results file holds of tasks scored as `scored_as` says, on `source` (the folder
    scored, which lines name when written outside its own eval/; None: lines naming none). A line
    torn by a kill is dropped."""
    kept = []
    for line in _read(results).splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            row = json.loads(line)
            if isinstance(row, dict) and "step" in row and isinstance(row.get("task"), str):
                if row.get("scored_as") == scored_as.get(row["task"]):
                    if row.get("source") == source:
                        kept.append(row)
    return kept


def _read(results: Path) -> str:
    """The file's text ('' if missing), opened without following a link, and only a plain file."""
    not_plain = QgtrainError(
        f"eval: {results} is not a plain file (a link, a FIFO or a folder); results are never "
        "read through one. HINT: remove it"
    )
    try:
        fd = os.open(results, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENXIO):
            raise
        raise not_plain from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise not_plain
        return handle.read().decode(errors="replace")


def figures(metrics: dict[str, Any]) -> str:
    """Metrics as the console shows them; a line read back from the file may hold anything, so
    names and whatever is not a number are shown escaped (foundation/terminal.py)."""

    def figure(value: Any) -> str:
        if value is None:
            return "n/a"
        return f"{value:.4f}" if isinstance(value, (int, float)) else shown(str(value))

    return " ".join(f"{shown(k)} {figure(v)}" for k, v in metrics.items())


def table(lines: list[dict[str, Any]]) -> str:
    """The results as the console shows them: one row per checkpoint and task (or split: val, test,
    with the loop's val_ and test_ figures), the text of lines read back from the file (written by
    whoever could write its folder) escaped."""
    rows = [("step", "task", "metrics")] + [
        (
            shown(str(line.get("step", "-"))),
            shown(str(line["task"])),
            figures({k: v for k, v in line.items() if k.startswith(FIGURES)}),
        )
        for line in lines
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return "\n".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}" for r in rows)
