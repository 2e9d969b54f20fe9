"""A run's life as its directory records it, for `qgtrain runs` and for the ranks that outlive a
failure.

Rank 0 records the status (running, then finished, stopped early, preempted, or failed with the
reason). A start refused before training begins for bad input (exit 2: a task that no longer fits
the checkpoint, a bad option) is not a failure of the run: the status is put back as it was, so a
finished run refused a restart still reads finished.

A rank that fails leaves a note before it leaves the process group; a rank whose collective then
breaks reads the note, so its message names the rank that failed first and why, not only "a peer
failed".
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..foundation.errors import EXIT_USAGE, PeerFailure, QgtrainError, TrainingError, summary
from ..foundation.files import write_atomic
from ..foundation.pinned import FolderReplaced
from ..foundation.user_code import raised_in_users_code
from ..runtime.log import traceback_to_file
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
        self._before: bytes | None = None  # status.json before this start (rank 0)
        if env.is_main:
            try:
                self._before = self.run.status.read_bytes()
            except OSError:
                pass
        self._training = False

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
                resumed=None,
            )

    def resumed(self, step: int, tier: str) -> None:
        """Where this start resumed from, for `qgtrain runs`: the step and the tier that held it."""
        if self.env.is_main:
            rundir.write_status(self.run_dir, "running", resumed={"step": step, "tier": tier})

    def training(self) -> None:
        """The run is built and restored and its steps begin: from here a failure is the run's."""
        self._training = True

    def ended(self, status: str, **facts: object) -> None:
        """Rank 0 records how the start ended. A record that cannot be written (a full disk) is
        a warning: it must not take the place of the failure it was to record."""
        if not self.env.is_main:
            return
        try:
            rundir.write_status(self.run_dir, status, **facts)
        except OSError as exc:
            log.warning("status.json does not say %s: %s", status, exc)

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
            told, gist = self._as_told(exc)
            self._leave_note(told, gist)
            if isinstance(told, QgtrainError):
                log.error("%s", told)  # every rank records why it stopped
            if self._refused(told):
                self._status_as_before()
            else:
                self.ended(
                    "failed",
                    error=str(told) if isinstance(told, QgtrainError) else summary(told),
                    retryable=is_retryable(told),
                )
            if told is not exc:
                raise told from exc
            raise

    def _as_told(self, exc: BaseException) -> tuple[BaseException, str | None]:
        """The failure as the user is told of it, and the gist the other ranks are told. What is
        not a QgtrainError leaves its traceback in this rank's log; where the user's own code
        raised it (a task function, loss, metrics, collate, a model) it becomes one line naming
        their function and that log, and the run's own failure: a new attempt would fail the same
        way."""
        if isinstance(exc, QgtrainError) or not isinstance(exc, Exception):
            return exc, None
        traceback_to_file(exc)
        where = raised_in_users_code(exc)
        if where is None:
            return exc, None
        gist = f"{summary(exc)}, raised in {where}"
        told = TrainingError(
            f"{gist}; its traceback is in {self.run.rank_log(self.env.rank)}. Your code's "
            "failure, not the machine's: not retried"
        )
        return told, gist

    def _refused(self, exc: BaseException) -> bool:
        """A start refused for its input (exit 2: a config, a checkpoint that does not fit) before
        training began, in a run that recorded a status before (a new run keeps the refusal as its
        status: it has nothing else to show). The user's code failing, even before the first step,
        is the run's failure (exit 1 or 3), and so is the machine's (retryable)."""
        return (
            isinstance(exc, QgtrainError)
            and exc.exit_code == EXIT_USAGE
            and not is_retryable(exc)
            and not self._training
            and self._before is not None
        )

    def _status_as_before(self) -> None:
        if self.env.is_main and self._before is not None:
            try:  # replaced whole, as every status is written
                write_atomic(self.run.status, self._before)
            except OSError:
                pass

    def _leave_note(self, exc: BaseException, gist: str | None = None) -> None:
        """Why this rank stopped, for the ranks whose collectives fail because of it (they cannot be
        told through the process group that is breaking) and for the batch script that decides
        whether to try again. Written before this rank leaves the group."""
        try:  # replaced whole, never written through a link planted at its name
            write_atomic(
                self.run.failure_note(self.env.rank),
                json.dumps({"message": gist or summary(exc), "retryable": is_retryable(exc)}),
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
