"""One run's checkpoints in the shared tier's folder (<run dir>/checkpoints), as the saves, a start
and a rollback all see it: a step staged, committed, listed and rotated out.

checkpoint.py owns the format of one checkpoint and rotation.py the rule of which go; this joins
them for one run, so a resume's candidates (resume.py), the ranks' check (verify_ranks.py), a
rollback's newest intact checkpoint and the checkpointer's saves read and write the same folder by
the same rules. The node-local tier's folder is local_files.LocalFolder. No torch: `qgtrain runs`
and a start's listing run before it is needed.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import checkpoint, layout, rotation
from .checkpoint import Checkpoint


@dataclass(frozen=True)
class Storage:
    root: Path
    run_id: str | None  # None: a run not started yet, which has no checkpoint of its own

    def stage(self, step: int) -> Path:
        """An empty staging folder for `step` (rank 0), in place of any an earlier attempt left."""
        staging = self.staging(step)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        return staging

    def staging(self, step: int) -> Path:
        """Where step `step` is written before its commit, known to every rank."""
        return checkpoint.staging_dir(self.root, step, str(self.run_id))

    def commit(
        self, staging: Path, step: int, files: dict[str, Any], meta: dict[str, Any]
    ) -> Checkpoint:
        """`staging` made step `step`'s checkpoint, its manifest listing `files` and `meta`."""
        done = {**meta, "step": step, "run_id": self.run_id}
        return checkpoint.commit(staging, self.folder(step), files, done)

    def folder(self, step: int) -> Path:
        return self.root / layout.step_folder(step)

    def committed(self) -> tuple[list[Checkpoint], list[str]]:
        """This run's committed checkpoints by step, and the ids of the other runs whose
        checkpoints the folder holds (never used): from one read of the manifests."""
        found = checkpoint.list_committed(self.root)
        ours = [c for c in found if c.run_id == self.run_id]
        return ours, sorted({c.run_id for c in found} - {self.run_id})

    def unreadable(self) -> list[Path]:
        return checkpoint.list_unreadable(self.root)

    def rotate(self, keep_last: int) -> list[Path]:
        """This run's checkpoints beyond the newest `keep_last` and the best, removed."""
        return rotation.rotate(self.root, str(self.run_id), keep_last)

    def clean(self) -> list[Path]:
        """What a killed attempt of this run left half-written or half-removed, removed."""
        return rotation.remove_stale_staging(self.root, str(self.run_id))
