"""The node-local tier's files: one folder per node, each rank's part of a step a self-contained
file with its checksum, so a start can tell a good copy from a torn, damaged or foreign one.

    <checkpoint.local_dir>/qgtrain-<run id>/     the user's own, 0700, on the node's own disk
        step-<N>/
            rank-<R>.pt      rank R's state, all it restores itself from (under fsdp its shards);
                             on the next node as well, as the replica of rank R
            rank-<R>.json    written last: format, run id, step, layout, size, xxh3
            whole.pt         ddp: the weights, optimizer and EMA (every rank holds the same), one
            whole.json       per node, written by its local rank 0

A part counts only when its .json parses, names this run, step and layout, and the file has
the size and checksum it records: a file half-written when a node died, damaged on disk or left by
another run is passed over with one line, and the start takes the newest step every rank can
restore from some copy (local_tier.py). Nothing here is fsynced: the local disk goes with its node,
a torn file is caught by its checksum, and the shared tier stays the durable one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..foundation.errors import QgtrainError
from ..foundation.trust import open_above, ownership_problem
from . import manifest_files

FORMAT = "qgtrain-local-1"
WHOLE = "whole"
_STEP = re.compile(r"step-(\d+)")
_TMP = ".tmp-"
_GOING = ".deleting-"


def part_name(rank: int) -> str:
    return f"rank-{rank}"


@dataclass(frozen=True)
class LocalFolder:
    """This node's folder for one run. `layout`: how the ranks hold the model (world size, ranks
    per node, strategy); a part saved under another is not this start's to read."""

    path: Path
    run_id: str
    layout: str

    def step(self, step: int) -> Path:
        return self.path / f"step-{step}"

    def steps(self) -> list[int]:
        """The steps with a folder here, newest first."""
        try:
            names = [p.name for p in self.path.iterdir() if p.is_dir()]
        except FileNotFoundError:
            return []
        return sorted((int(m.group(1)) for n in names if (m := _STEP.fullmatch(n))), reverse=True)

    def write(self, step: int, name: str, obj: Any) -> None:
        """One part, torch.save'd and committed (commit)."""
        import torch

        staged = self.staged(step, name, os.getpid())
        torch.save(obj, staged)
        self.commit(step, name, staged)

    def staged(self, step: int, name: str, writer: int = 0) -> Path:
        """Where the part `name` of `step` is written before it counts; by `writer` (a rank), so
        two ranks of a node given the same part do not write into one file."""
        folder = self.step(step)
        folder.mkdir(mode=0o700, exist_ok=True)
        return folder / f"{_TMP}{name}-{writer}.pt"

    def commit(self, step: int, name: str, staged: Path) -> None:
        """Make the written `staged` file the part: renamed into place, then its record written
        last, by rename, so a part whose record is there is whole."""
        entry = {
            "format": FORMAT,
            "run_id": self.run_id,
            "step": step,
            "layout": self.layout,
            "size": staged.stat().st_size,
            "xxh3": manifest_files.digest(staged),
        }
        folder = self.step(step)
        (folder / f"{name}.json").unlink(missing_ok=True)  # the part's old bytes go first
        os.replace(staged, self.part(step, name))
        staged_record = staged.with_suffix(".json")
        staged_record.write_text(json.dumps(entry))
        os.replace(staged_record, folder / f"{name}.json")

    def part(self, step: int, name: str) -> Path:
        return self.step(step) / f"{name}.pt"

    def problem(self, step: int, name: str) -> str | None:
        """Why the part `name` of `step` here cannot be used, or None: it is complete, this run's,
        and its bytes are those recorded."""
        folder = self.step(step)
        record, data = folder / f"{name}.json", folder / f"{name}.pt"
        try:
            entry = json.loads(manifest_files.read_regular(record))
        except FileNotFoundError:
            return f"{data} is incomplete (no {record.name}: its write did not finish)"
        except (OSError, ValueError, manifest_files.UnsafeFile) as exc:
            return f"{record} cannot be read ({exc})"
        if not isinstance(entry, dict):
            return f"{record} is not a record of a local checkpoint"
        if entry.get("run_id") != self.run_id:
            return (
                f"{data} belongs to another run (run id {entry.get('run_id')}, not {self.run_id})"
            )
        if entry.get("layout") != self.layout:
            return f"{data} was saved by {entry.get('layout')}, this start is {self.layout}"
        if (entry.get("format"), entry.get("step")) != (FORMAT, step):
            return f"{record} is not the record of {FORMAT} step {step}"
        try:
            size = os.stat(data).st_size
            if size != entry.get("size"):
                return f"{data} has {size} bytes, {entry.get('size')} were written (damaged)"
            if manifest_files.digest(data) != entry.get("xxh3"):
                return f"{data} fails its checksum (damaged)"
        except (OSError, manifest_files.UnsafeFile) as exc:
            return f"{data} cannot be read ({exc})"
        return None

    def keep_newest(self, keep: int) -> list[Path]:
        """Remove all but the newest `keep` steps, and any removal a kill interrupted; returns
        what went. A step is renamed out of the way first, so a kill in the middle of removing it
        leaves no step with some of its files."""
        gone = [self.step(step) for step in self.steps()[keep:]]
        for folder in gone:
            os.rename(folder, folder.with_name(f"{_GOING}{folder.name}"))
        for going in self.path.glob(f"{_GOING}*"):
            shutil.rmtree(going, ignore_errors=True)
        return gone


def node_folder(local_dir: str, run_id: str, layout: str) -> LocalFolder:
    """checkpoint.local_dir, its $VARS expanded on this node, made the user's own if missing, and
    refused where another user could put files there (they are loaded as tensors, never run, but a
    planted one could set the weights)."""
    expanded = os.path.expandvars(os.path.expanduser(local_dir))
    if "$" in expanded:
        raise QgtrainError(
            f"checkpoint.local_dir: {local_dir!r} names a variable this node does not set "
            f"({expanded}); HINT: use one every node of the job sets, such as $SLURM_TMPDIR or "
            "$SLURM_JOB_ID, or a plain path"
        )
    path = Path(expanded).absolute() / f"qgtrain-{run_id}"
    refusal, _ = open_above(path)
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = refusal or ownership_problem(path, os.lstat(path))
    except OSError as exc:
        problem = f"{path} cannot be made ({exc.strerror or exc})"
    if problem:
        raise QgtrainError(
            f"checkpoint.local_dir: {problem}. HINT: a folder of your own on the node's own disk, "
            "writable by no one else"
        )
    return LocalFolder(path, run_id, layout)
