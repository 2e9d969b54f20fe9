"""Which checkpoint folders go: this run's beyond the newest `keep_last` and the best, and what a
killed run left half-written or half-deleted. Apart from checkpoint.py, which writes and reads one
checkpoint; this decides about the folder of them, by step number and run id only, never by name
order or time."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import layout
from .checkpoint import list_committed


def rotate(root: Path, run_id: str, keep_last: int) -> list[Path]:
    """Delete this run's checkpoints beyond the newest `keep_last` and the best by its score.

    Ordered by step number, never by name or time; other runs' folders and anything uncommitted are
    left.
    """
    ours = [c for c in list_committed(root) if c.run_id == run_id]
    keep = {c.path for c in ours[-keep_last:]}
    scored = [c for c in ours if c.score is not None]
    if scored:
        keep.add(min(scored, key=lambda c: (c.score, -c.step)).path)
    removed = []
    for ckpt in ours:
        if ckpt.path not in keep:
            doomed = ckpt.path.with_name(f"{layout.DELETING_PREFIX}{ckpt.path.name}")
            os.rename(ckpt.path, doomed)  # no longer a checkpoint the instant it is renamed
            shutil.rmtree(doomed, ignore_errors=True)
            removed.append(ckpt.path)
    return removed


def remove_stale_staging(root: Path, run_id: str) -> list[Path]:
    """Half-written folders this run left when it was killed, and interrupted deletions."""
    if not root.is_dir():
        return []
    ours = f"-{run_id}"
    stale = [
        p
        for p in root.iterdir()
        if (p.name.startswith(layout.STAGING_PREFIX) and p.name.endswith(ours))
        or p.name.startswith((layout.DELETING_PREFIX, layout.REPLACED_PREFIX))
    ]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale
