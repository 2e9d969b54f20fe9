"""A run's life as its directory records it, for `qgtrain runs` and for the ranks that outlive a failure.

Rank 0 records the status (running, then finished, stopped early, preempted, or failed with the reason).
A rank that fails leaves a note before it leaves the process group; a rank whose collective then breaks
reads the note, so its message names the rank that failed first and why, not only "a peer failed".
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from ..errors import PeerFailure, QgtrainError, summary
from ..runtime.rendezvous import DistEnv
from . import rundir

log = logging.getLogger("qgtrain")


class Lifecycle:
    def __init__(self, run_dir: Path, env: DistEnv) -> None:
        self.run_dir, self.run, self.env = run_dir, rundir.RunDir(run_dir), env

    def started(self) -> None:
        self.run.failure_note(self.env.rank).unlink(missing_ok=True)  # a note found later is from this attempt
        if self.env.is_main:
            env = self.env
            rundir.write_status(self.run_dir, "running", job_id=env.requeue_id, restart=env.restart_count,
                                error=None, host=env.node_name, ranks=env.world_size, started=time.time())

    def ended(self, status: str, **facts: object) -> None:
        if self.env.is_main:
            rundir.write_status(self.run_dir, status, **facts)

    @contextlib.contextmanager
    def failures_recorded(self) -> Iterator[None]:
        """Record why training failed, on this rank and (rank 0) in the status, and let the failure go on."""
        try:
            yield
        except PeerFailure as exc:  # another rank stopped first: say which, and why, if it left a note
            note = self._first_note()
            error = PeerFailure(f"{note}; rank {self.env.rank} stopped with it" if note else str(exc))
            log.error("%s", error)
            self.ended("failed", error=str(error))
            raise error from exc
        except BaseException as exc:  # this rank's own failure: noted for the others before the group goes
            self._leave_note(summary(exc))
            if isinstance(exc, QgtrainError):
                log.error("%s", exc)  # every rank records why it stopped
            self.ended("failed", error=str(exc) if isinstance(exc, QgtrainError) else summary(exc))
            raise

    def _leave_note(self, message: str) -> None:
        """Why this rank stopped, for the ranks whose collectives fail because of it (they cannot be told
        through the process group that is breaking). Written before this rank leaves the group."""
        try:
            self.run.failure_note(self.env.rank).write_text(message)
        except OSError:
            pass

    def _first_note(self, wait_s: float = 2.0) -> str | None:
        """'rank N failed: <why> (its log: ...)' for the first other rank that left a note, or None."""
        deadline = time.monotonic() + wait_s
        while True:
            for other in range(self.env.world_size):
                try:
                    text = self.run.failure_note(other).read_text().strip() if other != self.env.rank else ""
                except OSError:
                    text = ""
                if text:
                    return f"rank {other} failed: {text} (its log: {self.run.rank_log(other)})"
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)
