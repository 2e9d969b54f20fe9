"""A run's life as its directory records it, for `qgtrain runs` and for the ranks that outlive a
failure.

Rank 0 records the status (running, then finished, stopped early, preempted, or failed with the
reason). A rank that fails leaves a note before it leaves the process group; a rank whose collective
then breaks reads the note, so its message names the rank that failed first and why, not only "a
peer failed".
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..foundation.errors import PeerFailure, QgtrainError, summary
from ..foundation.files import write_atomic
from ..foundation.pinned import FolderReplaced
from ..runtime.rendezvous import DistEnv
from . import rundir

log = logging.getLogger("qgtrain")


def is_retryable(exc: BaseException) -> bool:
    """Whether a new attempt may succeed: only failures qgtrain recognised as the machine's."""
    return isinstance(exc, QgtrainError) and exc.retryable


def read_note(run: rundir.RunDir, rank: int) -> dict[str, Any] | None:
    """A rank's failure note ({"message", "retryable"}), or None if it left none (it is alive, or
    was killed before it could write one)."""
    try:
        text = run.failure_note(rank).read_text().strip()
    except OSError:
        return None
    try:
        note = json.loads(text)
    except ValueError:  # half-written by a rank killed while writing it
        return {"message": text, "retryable": True} if text else None
    return note if isinstance(note, dict) and "message" in note else None


class Lifecycle:
    def __init__(self, run_dir: Path, env: DistEnv) -> None:
        self.run_dir, self.run, self.env = run_dir, rundir.RunDir(run_dir), env

    def started(self) -> None:
        # a note found later is from this attempt
        self.run.failure_note(self.env.rank).unlink(missing_ok=True)
        if self.env.is_main:
            env = self.env
            rundir.write_status(
                self.run_dir,
                "running",
                job_id=env.requeue_id,
                restart=env.restart_count,
                error=None,
                host=env.node_name,
                ranks=env.world_size,
                started=time.time(),
            )

    def ended(self, status: str, **facts: object) -> None:
        if self.env.is_main:
            rundir.write_status(self.run_dir, status, **facts)

    @contextlib.contextmanager
    def failures_recorded(self) -> Iterator[None]:
        """Record why training failed, on this rank and (rank 0) in the status, and let the failure
        go on."""
        try:
            yield
        # another rank stopped first: say which, and why, if it left a note
        except PeerFailure as exc:
            first = self._first_note()
            error = PeerFailure(
                f"rank {first[0]} failed: {first[1]['message']} (its log: "
                f"{self.run.rank_log(first[0])}); rank {self.env.rank} stopped with it"
                if first
                else str(exc)
            )
            log.error("%s", error)
            self.ended(
                "failed", error=str(error), retryable=bool(first[1]["retryable"]) if first else True
            )
            raise error from exc
        # the path names someone else's folder now: nothing is written there, not even why
        except FolderReplaced as exc:
            log.error("%s", exc)
            raise
        # this rank's own failure: noted for the others before the group goes
        except BaseException as exc:
            self._leave_note(exc)
            if isinstance(exc, QgtrainError):
                log.error("%s", exc)  # every rank records why it stopped
            self.ended(
                "failed",
                error=str(exc) if isinstance(exc, QgtrainError) else summary(exc),
                retryable=is_retryable(exc),
            )
            raise

    def _leave_note(self, exc: BaseException) -> None:
        """Why this rank stopped, for the ranks whose collectives fail because of it (they cannot be
        told through the process group that is breaking) and for the batch script that decides
        whether to try again. Written before this rank leaves the group."""
        try:  # replaced whole, never written through a link planted at its name
            write_atomic(
                self.run.failure_note(self.env.rank),
                json.dumps({"message": summary(exc), "retryable": is_retryable(exc)}),
            )
        except OSError:
            pass

    def _first_note(self, wait_s: float = 2.0) -> tuple[int, dict[str, Any]] | None:
        """The first other rank that left a note, and its note; None if none did within `wait_s`."""
        deadline = time.monotonic() + wait_s
        while True:
            for other in range(self.env.world_size):
                note = read_note(self.run, other) if other != self.env.rank else None
                if note:
                    return other, note
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)
