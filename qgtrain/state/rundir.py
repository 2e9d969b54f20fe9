"""The run directory: where it is, what it holds, which run it belongs to, and who may write it.

    <run dir>/config.yaml        the resolved config of the latest start
    <run dir>/run.json           the run id that checkpoints are matched against, across requeues
    <run dir>/status.json        what rank 0 last recorded: running, finished, stopped early, preempted, failed
    <run dir>/metrics.jsonl      one JSON object per logged step (rank 0)
    <run dir>/logs/rank_<N>.log  every rank's log, appended across restarts
    <run dir>/tb/                TensorBoard events
    <run dir>/checkpoints/       step-<N>/ folders (see checkpoint.py)
    <run dir>/.lock              held by the rank 0 that is training in it

The directory follows from the config alone (<logging.runs_dir>/<train.run_name>), so a requeued job finds
it again without being told.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from ..config import RunConfig
from ..errors import QgtrainError

RUN_FILE = "run.json"
STATUS_FILE = "status.json"
LOCK_FILE = ".lock"


def default_run_dir(cfg: RunConfig) -> Path:
    return Path(cfg.logging.runs_dir) / cfg.train.run_name


def read_run_id(run_dir: Path) -> str | None:
    try:
        return str(json.loads((run_dir / RUN_FILE).read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def open_run(run_dir: Path, cfg: RunConfig, config_yaml: str) -> str:
    """Record the resolved config; return this run's id: the recorded one, or a new one for a fresh start."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml)
    previous = read_run_id(run_dir)
    if previous and cfg.checkpoint.resume != "never":
        return previous
    run_id = uuid.uuid4().hex[:12]
    metrics = run_dir / "metrics.jsonl"
    if previous and metrics.exists():  # a fresh start over an earlier run keeps that run's history beside it
        metrics.rename(run_dir / f"metrics.{previous}.jsonl")
    tmp = run_dir / f"{RUN_FILE}.tmp"
    tmp.write_text(json.dumps({"run_id": run_id, "run_name": cfg.train.run_name, "created": time.time()}))
    os.replace(tmp, run_dir / RUN_FILE)
    return run_id


@contextlib.contextmanager
def exclusive(run_dir: Path, owner: str, wait_s: float = 60.0) -> Iterator[None]:
    """Hold the run directory's lock; fail clearly if another job keeps it longer than `wait_s`.

    A requeued job may start while its previous allocation is still exiting, hence the wait. The lock is
    an flock, released by the kernel when its holder dies, so it never goes stale.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP):  # a filesystem without locks: go unguarded
                    break
                if time.monotonic() > deadline:
                    holder = path.read_text().strip() or "another process"
                    raise QgtrainError(f"run directory {run_dir} is in use by {holder}. HINT: wait for that job "
                                       "to end, or give this one another --run-dir or train.run_name") from None
                time.sleep(0.5)
        os.ftruncate(fd, 0)
        os.write(fd, f"{owner} (pid {os.getpid()} on {socket.gethostname()})".encode())
        yield
    finally:
        os.close(fd)


def write_status(run_dir: Path, status: str, **facts: object) -> None:
    """Record the run's state for `qgtrain runs` (rank 0, atomically); facts are merged into the last record."""
    path = run_dir / STATUS_FILE
    record = read_status(run_dir)
    record.update(facts, status=status, updated=time.time())
    tmp = run_dir / f"{STATUS_FILE}.tmp"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def read_status(run_dir: Path) -> dict[str, object]:
    try:
        record = json.loads((run_dir / STATUS_FILE).read_text())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def failure_note(run_dir: Path, rank: int) -> Path:
    return run_dir / "logs" / f"failed-rank-{rank}.txt"


def clear_failure_note(run_dir: Path, rank: int) -> None:
    """Each rank removes its own note when it starts, so any note found later is from this attempt."""
    failure_note(run_dir, rank).unlink(missing_ok=True)


def write_failure_note(run_dir: Path, rank: int, message: str) -> None:
    """Why this rank stopped, for the ranks whose collectives fail because of it (they cannot be told
    through the process group that is breaking). Written before this rank leaves the group."""
    try:
        failure_note(run_dir, rank).write_text(message)
    except OSError:
        pass


def read_failure_note(run_dir: Path, rank: int, world_size: int, wait_s: float = 2.0) -> str | None:
    """'rank N failed: <why> (its log: ...)' for the first other rank that left a note, or None."""
    deadline = time.monotonic() + wait_s
    while True:
        for other in range(world_size):
            try:
                text = failure_note(run_dir, other).read_text().strip() if other != rank else ""
            except OSError:
                text = ""
            if text:
                return f"rank {other} failed: {text} (its log: {run_dir / 'logs' / f'rank_{other}.log'})"
        if time.monotonic() > deadline:
            return None
        time.sleep(0.2)


def is_locked(run_dir: Path) -> bool | None:
    """Whether a process holds the run directory's lock now (None where the filesystem cannot say)."""
    try:
        fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError as exc:
        return None if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP) else True
    finally:
        os.close(fd)
