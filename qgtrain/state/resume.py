"""Which checkpoint a start resumes from, and the refusal when a run has checkpoints but none is
usable."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..foundation.errors import CheckpointError
from .checkpoint import Checkpoint, read_manifest, verify
from .layout import MANIFEST, MODEL_FACTS
from .storage import Storage


@dataclass(frozen=True)
class Candidates:
    """The checkpoints a start may resume from, newest first, as rank 0 finds them from manifests
    and file sizes; every rank then checks its share of the files of the first (verify_ranks.py)."""

    paths: list[str]
    problems: list[str]  # those passed over already, for the refusal if none is left
    named: bool = False  # checkpoint.resume named one: no other may be used instead


def resume_candidates(storage: Storage, resume: str, warn: Callable[[str], None]) -> Candidates:
    """The checkpoints a start may resume from: this run's committed ones whose files have the sizes
    their manifest records (a stat per file, nothing read), newest first; or the one named.

    A damaged newest checkpoint is passed over with a warning and the one before it is tried.
    """
    if resume == "never":
        return Candidates([], [])
    if resume != "auto":
        ckpt = read_manifest(Path(resume))
        if ckpt is None:
            raise CheckpointError(
                f"checkpoint.resume: {resume} is not a committed checkpoint (no valid {MANIFEST}); "
                "expected a folder such as <run dir>/checkpoints/step-<N>, or 'auto' or 'never'"
            )
        problem = verify(ckpt, checksums=False)
        if problem:
            raise CheckpointError(f"checkpoint.resume: {problem}")
        return Candidates([str(ckpt.path)], [], named=True)
    ours, others = storage.committed()
    if others:
        warn(f"ignoring checkpoints of other runs in {storage.root} (run ids {', '.join(others)})")
    problems, paths = [], []
    for folder in storage.unreadable():
        problems.append(f"{folder.name}: no valid {MANIFEST} (removed or damaged)")
        warn(
            f"passing over {folder}: it has no valid {MANIFEST} (removed or damaged), so its files "
            "cannot be checked"
        )
    for ckpt in reversed(ours):
        problem = verify(ckpt, checksums=False)
        if problem is None:
            paths.append(str(ckpt.path))
            continue
        warn(f"skipping checkpoint {ckpt.path.name}: {problem}; trying the one before it")
        problems.append(f"{ckpt.path.name}: {problem}")
    return Candidates(paths, problems)


def refusal(root: Path, problems: list[str]) -> CheckpointError:
    """A run that has checkpoints but none that can be used is refused, never silently restarted
    from scratch: the error names each checkpoint and what is wrong with it, and nothing has been
    touched."""
    return CheckpointError(
        f"{root} holds {len(problems)} checkpoint(s) of this run and none can be resumed ("
        f"{'; '.join(problems)}). Nothing was changed. HINT: restore a good copy of one of them, "
        "or start afresh with checkpoint.resume: never or another train.run_name"
    )


def data_change(ckpt: Checkpoint, facts: dict[str, object]) -> str | None:
    """A warning when the task's data is not what the checkpoint was trained on (a data file
    changed, so its cache was prepared again): the run goes on, from the same sample position, on
    the new data."""
    try:
        saved = json.loads((ckpt.path / MODEL_FACTS).read_text()).get("data")
    except (OSError, ValueError):
        return None
    now = facts.get("data")
    if saved is None or now is None or saved == now:
        return None
    return (
        f"the data changed since checkpoint step {ckpt.step}: it was trained on {saved}, this "
        f"start reads {now} (a data file was changed or added); training continues on the new data "
        "from the same sample position, so its order is not the uninterrupted run's"
    )
