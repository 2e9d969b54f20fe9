"""Saving and restoring a run's checkpoints with every rank on the same collective path.

Save: rank 0 makes the staging folder; every rank writes its own file (RNG and data position) and
rank 0 the replicated state; rank 0 gathers every rank's file entries (or its error), commits,
rotates, and broadcasts the outcome, so all ranks succeed or fail together. The saver has its own
gloo group: an asynchronous save runs these collectives in a background thread without interleaving
with training's.

Restore: rank 0 lists the checkpoints before anything of the run is written
(resume.resume_candidates), the ranks check their shares of the files and agree on one
(verify_ranks.py); each rank then reads the replicated files and its own. The trainer's state comes
and goes as a table of named parts (save_parts, restore; named.py turns it into these files and
back).
"""

from __future__ import annotations

import datetime
import enum
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..config.checkpoint import CheckpointConfig
from ..foundation.errors import CheckpointWriteError, QgtrainError, TrainingError
from ..foundation.forking import finished_before_fork
from ..foundation.pinned import FolderReplaced, Pinned
from ..runtime import objects
from ..runtime.distributed import gather_to_main
from ..runtime.rendezvous import DistEnv
from . import checkpoint, local_tier, named, sharded, verify_ranks
from .cadence import ByClock
from .host_copy import HostCopy, buffer_specs
from .layout import rank_file
from .local_tier import LocalCheckpoint, LocalTier
from .storage import Storage

log = logging.getLogger("qgtrain")


class Why(enum.Enum):
    """Why a step is saved, which says where and whether the loop waits for it."""

    EVERY = "every"  # checkpoint.every_steps or every_minutes: the shared tier
    LOCAL = "local"  # checkpoint.local_every_steps: the node-local tier (local_tier.py)
    STOP = "stop"  # a stop to resume later, or early stopping: shared, durable before going on
    FINAL = "final"  # the run's end: shared and durable
    FINAL_AGAIN = "final again"  # the final work of an earlier allocation's last step: replaces it


class Checkpointer:
    def __init__(
        self,
        root: Path,
        run_id: str,
        env: DistEnv,
        cfg: CheckpointConfig,
        run_files: dict[str, bytes] | None = None,
        timeout_s: float = 300.0,
        pin: Pinned | None = None,
        saves_shards: bool = False,
        local: LocalTier | None = None,
    ) -> None:
        """`cfg`, its own section of the config: how many kept, written in the background or not,
        and when a save is due (due, due_by_clock). `run_files` (the resolved config, the model's
        own config) go into every checkpoint as they are. `timeout_s` bounds each of the saver's
        collectives, as train.collective_timeout_s bounds training's: without it gloo waits half an
        hour, and a rank cut off in the middle of a save would outlive the others by that much.
        `pin`: the run folder checked at start, which each save first checks is still there.
        `saves_shards`: the strategy's route: every rank's shards by DCP, else rank 0's files.
        `local`: the node-local tier, written between the shared tier's saves (local_tier.py)."""
        self.storage, self.env, self.pin = Storage(root, run_id), env, pin
        self.saves_shards, self.local = saves_shards, local
        self.run_files = run_files or {}
        self.keep_last, self.async_save = cfg.keep_last, cfg.async_save
        self.every_steps, self.every_minutes = cfg.every_steps, cfg.every_minutes
        self._clock = ByClock(time.monotonic())  # checkpoint.every_minutes
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.last_step: int | None = None
        self._thread: threading.Thread | None = None
        self._failure: QgtrainError | None = None
        self._host_copy = HostCopy(timeout_s)
        self._local_copy = HostCopy(timeout_s)  # the local parts are laid out apart: own buffers
        if env.is_main:
            for path in self.storage.clean():
                log.warning("removed a half-written checkpoint left by a killed job: %s", path)

    @classmethod
    def for_run(
        cls,
        root: Path,
        run_id: str,
        env: DistEnv,
        cfg: RunConfig,
        files: dict[str, bytes],
        pin: Pinned,
        saves_shards: bool,
        local: LocalTier | None,
    ) -> Checkpointer:
        """The run's checkpointer (in `root`, the run directory's checkpoints) from its own
        sections; `files` (layout.run_files) go in each."""
        timeout = cfg.train.collective_timeout_s
        return cls(root, run_id, env, cfg.checkpoint, files, timeout, pin, saves_shards, local)

    def due(self, step: int) -> bool:
        """checkpoint.every_steps: whether step `step` is saved; a function of the step, so every
        rank gives the same answer."""
        return bool(self.every_steps) and step % self.every_steps == 0

    def due_locally(self, step: int) -> bool:
        """checkpoint.local_every_steps: whether step `step` goes to the node-local tier."""
        return self.local is not None and self.local.cadence.due(step)

    def due_locally_by_clock(self) -> bool:
        """checkpoint.local_every_steps: auto, by rank 0's clock (the others say False, and the
        trainer agrees on rank 0's answer)."""
        return (
            self.env.is_main
            and self.local is not None
            and self.local.cadence.due_by_clock(time.monotonic())
        )

    def due_by_clock(self) -> bool:
        """checkpoint.every_minutes since the last save, by rank 0's clock: the ranks' clocks
        differ, so the trainer agrees on rank 0's answer (the others say False); asked once per
        save (cadence.ByClock)."""
        every = 60 * self.every_minutes
        return self.env.is_main and bool(every) and self._clock.due(time.monotonic(), every)

    def due_now(self, step: int, by_clock: bool, locally_by_clock: bool) -> Why | None:
        """Why step `step` is saved on the cadence, if it is: the shared tier's before the local
        one's. `by_clock`, `locally_by_clock`: rank 0's due_by_clock and due_locally_by_clock,
        as every rank agreed on them."""
        if by_clock or self.due(step):
            return Why.EVERY
        if locally_by_clock or self.due_locally(step):
            return Why.LOCAL
        return None

    def prepare(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, copies_here: bool
    ) -> None:
        """At start: checkpoint.every_minutes counts from here (building the parts trained nothing
        worth saving); for asynchronous saves that copy on this rank (`copies_here`), pin the host
        buffers in the background (host_copy.py), so the first save does not stall on it; the
        node-local tier's too, where this rank copies the model's state for it."""
        self._clock.saved(time.monotonic())
        if self.async_save:
            self._host_copy.prepare(buffer_specs(model, optimizer, copies_here))
            if self.local is not None:
                local = self.local.copies_state
                self._local_copy.prepare(buffer_specs(model, optimizer, local))

    def save(
        self,
        step: int,
        replicated: Callable[[], dict[str, Any]],
        per_rank: dict[str, Any],
        meta: dict[str, Any],
        *,
        blocking: bool = False,
        shards: dict[str, Any] | None = None,
        again: bool = False,
    ) -> None:
        """Checkpoint `step` (every rank calls this). `replicated` is called on rank 0 only;
        `shards`, a sharded model's and optimizer's state, is written by every rank (sharded.py).

        Synchronous: files are written and committed now; fsync and rotation finish in the
        background. Asynchronous (checkpoint.async_save): state is copied to CPU memory now and
        everything else runs in the background. `blocking` waits until the checkpoint is durable
        (the final and stop saves). At most one save is in flight: the next one first waits for this
        one. A step is saved once, unless `again` (its final evaluation was done by a later
        allocation): the new checkpoint replaces it.
        """
        self.wait()
        if step != self.last_step or again:
            files = {**replicated(), **self.run_files} if self.env.is_main else {}
            files[rank_file(self.env.rank)] = per_rank
            if shards is not None:
                files[sharded.FOLDER] = shards
            if self.async_save and not blocking:
                self._background(self._write_and_settle, step, self._host_copy.copy(files), meta)
            else:
                ckpt, names = self._write(step, files, meta)
                if blocking:
                    self._settle(ckpt, names)
                else:
                    self._background(self._settle, ckpt, names)
            self.last_step = step
        self._clock.saved(time.monotonic())  # checkpoint.every_minutes counts from here

    def save_parts(self, step: int, parts: named.Parts, meta: dict[str, Any], why: Why) -> None:
        """`save` of a table of named parts, each where layout.PLACES puts it (named.py), or to the
        node-local tier (save_locally), as `why` says."""
        if why is Why.LOCAL:
            self.save_locally(step, parts)
            return
        self.save(
            step,
            lambda: named.replicated_files(parts, self.saves_shards),
            named.rank_entries(parts),
            meta,
            blocking=why is not Why.EVERY,
            shards=named.shards(parts) if self.saves_shards else None,
            again=why is Why.FINAL_AGAIN,
        )

    def save_locally(self, step: int, parts: named.Parts) -> None:
        """Every rank's part of `step` into the node-local tier, and its replica to the next node
        (local_tier.py): all in the background after a host copy under checkpoint.async_save."""
        assert self.local is not None, "no checkpoint.local_dir"
        began = time.perf_counter()
        self.wait()
        own, whole = self.local.split({name: part.state_dict() for name, part in parts.items()})
        if self.async_save:
            own, whole = self._local_copy.copy((own, whole))
            self._background(self.local.save, step, own, whole)
        else:  # written now; the replica and the rotation in the background, as a shared fsync
            self._background(self.local.spread, step, self.local.write(step, own, whole))
        stall = time.perf_counter() - began
        self.local.cadence.saved(stall, time.monotonic(), tell=self.env.is_main)

    def restore(self, ckpt: checkpoint.Checkpoint | LocalCheckpoint, parts: named.Parts) -> None:
        """Every part from `ckpt` (chosen and checked by every rank: verify_ranks.py, or
        local_tier.py for the node-local tier)."""
        if isinstance(ckpt, LocalCheckpoint):
            local_tier.restore(ckpt, parts, str(self.storage.run_id), self.saves_shards)
            return
        named.load(ckpt, parts, self.env.rank, self.saves_shards)
        self.last_step = ckpt.step

    def newest_intact(self, step: int) -> checkpoint.Checkpoint | None:
        """The newest checkpoint at or before `step` that every rank finds intact, once the save in
        flight (which may be it) is done: where a rollback goes back to (collectives)."""
        self.wait()
        return verify_ranks.newest_intact(self.storage, step)

    @property
    def failed(self) -> bool:
        """A background save has failed and not been reported yet (agreed on by the trainer each
        step)."""
        return self._failure is not None

    def wait(self) -> None:
        """Let the save in flight finish; raise its failure (the same on every rank)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure

    def _background(self, work: Callable[..., None], *args: Any) -> None:
        def run() -> None:
            try:
                work(*args)
            except FolderReplaced as exc:  # no write failed: nothing to try again
                self._failure = exc
            except TrainingError as exc:
                self._failure = CheckpointWriteError(str(exc))
            # recorded, so that the next wait reports it instead of success
            except BaseException as exc:
                self._failure = CheckpointWriteError(
                    f"the background checkpoint writer failed: {type(exc).__name__}: {exc}"
                )

        # a DataLoader worker forked meanwhile would inherit the locks this thread holds
        self._thread = finished_before_fork(
            threading.Thread(target=run, name="qgtrain-checkpoint", daemon=True)
        )
        self._thread.start()

    def _write_and_settle(self, step: int, files: dict[str, Any], meta: dict[str, Any]) -> None:
        self._settle(*self._write(step, files, meta))

    def _write(
        self, step: int, files: dict[str, Any], meta: dict[str, Any]
    ) -> tuple[Path, list[str]]:
        """Write this rank's files, commit on rank 0; all ranks learn the outcome (collectives).
        Returns the checkpoint and the names of the files this rank wrote."""
        started = time.perf_counter()
        self._still_pinned()
        staging = self.storage.staging(step)
        error = None
        if self.env.is_main:
            try:
                self.storage.stage(step)
            except OSError as exc:
                error = f"rank 0 cannot create {staging}: {exc.strerror or exc}"
        # no rank writes into a folder that is not there
        error = objects.broadcast(error, self.group, "staging folder")
        entries: dict[str, Any] = {}
        shards, staged = files.pop(sharded.FOLDER, None), error is None
        if error is None:
            try:
                entries = checkpoint.write_files(staging, files)
            # torch.save reports a full disk as a RuntimeError
            except (OSError, RuntimeError) as exc:
                why = checkpoint.explain_write_error(exc, staging, files)
                error = f"rank {self.env.rank} cannot write {staging}: {why}"
        # a collective: every rank takes part, also one whose files failed
        if shards is not None and staged:
            try:
                entries.update(sharded.write(staging, shards, self.env.rank, self.group))
            except (OSError, RuntimeError, sharded.dcp_error()) as exc:
                why = checkpoint.explain_write_error(exc, staging, shards)
                error = (
                    error or f"rank {self.env.rank} cannot write its shard into {staging}: {why}"
                )
        gathered = gather_to_main((entries, error), group=self.group)
        self._still_pinned(staging)  # before the commit renames it into checkpoints/
        outcome = (
            self._commit(step, staging, gathered, meta, started) if gathered is not None else None
        )
        outcome = objects.broadcast(outcome, self.group, "checkpoint outcome")
        if outcome is not None:
            raise CheckpointWriteError(
                f"checkpoint at step {step} failed: {outcome}. The previous checkpoint is "
                "intact; HINT: check free space and permissions where the run directory lives"
            )
        return self.storage.folder(step), list(entries)

    def _still_pinned(self, staging: Path | None = None) -> None:
        """Rank 0 checks that the run folder is the one checked at start (Pinned), and every rank
        stops alike if not: nothing more is written into a folder someone put in its place. A
        `staging` folder the ranks wrote while it was swapped in is taken out of it again (by
        shutil's fd-based removal, which follows no link planted meanwhile)."""
        line = self.pin.replaced() if self.pin is not None and self.env.is_main else None
        if line and staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        if line := objects.broadcast(line, self.group, "run folder check"):
            raise FolderReplaced(line)

    def _commit(
        self, step: int, staging: Path, gathered: list[Any], meta: dict[str, Any], started: float
    ) -> str | None:
        errors = [error for _, error in gathered if error]
        if not errors:
            files = {name: entry for entries, _ in gathered for name, entry in entries.items()}
            done = {**meta, "world_size": self.env.world_size}
            try:
                ckpt = self.storage.commit(staging, step, files, done)
                mb = sum(entry["size"] for entry in files.values()) / 1e6
                took = time.perf_counter() - started
                log.info("saved checkpoint %s (%.1f MB written in %.2f s)", ckpt.path, mb, took)
                return None
            except OSError as exc:
                errors.append(f"rank 0 cannot commit {staging}: {exc.strerror or exc}")
        shutil.rmtree(staging, ignore_errors=True)
        return "; ".join(errors)

    def _settle(self, folder: Path, names: list[str]) -> None:
        """Make this rank's files durable; then rank 0 rotates, so nothing old goes before the new
        is safe.

        No collective here: a failed fsync leaves a checkpoint whose checksums catch any damage, so
        it is a warning, not a reason to stop every rank.
        """
        if self.env.is_main:
            names = [*names, checkpoint.MANIFEST]
        for problem in checkpoint.make_durable(folder, names):
            log.warning("could not fsync %s; the previous checkpoint stays the fallback", problem)
        if self.env.is_main:
            try:
                for path in self.storage.rotate(self.keep_last):
                    log.info("rotated out %s", path.name)
            except OSError as exc:
                log.warning("could not rotate old checkpoints in %s: %s", self.storage.root, exc)
