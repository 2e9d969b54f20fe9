"""The node-local tier: checkpoints every few steps on each node's own disk, each rank's part also
kept on the next node, and the choice at start of the newest step every rank can restore.

A save: every rank writes its part (local_files.py), under ddp each node's local rank 0 also the
whole model; then, in the checkpointer's background thread on this tier's own gloo group, each rank
sends its part to the same local rank on the next node, which keeps it as a replica, and once every
rank is done (a barrier) each node drops its steps beyond checkpoint.local_keep, so a step is
removed only after a newer one is complete everywhere. Under checkpoint.async_save the write is in
the background too. A write that fails is a warning: the shared tier stays the durable one.

A start: each rank checks what it holds (its own part, the replica it keeps, the whole model) by
checksum, newest first, and names any copy it passes over in one line; the ranks gather what each
found and every rank works out the same answer: the newest step for which every part is held
somewhere, and who sends what to whom. A damaged copy is never chosen, so a start never loops on
it. Only a start on the same number of ranks per node and nodes reads this tier; any other resumes
from the shared one.
"""

from __future__ import annotations

import datetime
import logging
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config.checkpoint import CheckpointConfig
from ..foundation.errors import CheckpointError, first_line
from ..runtime import distributed, objects, transfer
from ..runtime.rendezvous import DistEnv
from . import sharded
from .cadence import LocalCadence
from .checkpoint import Checkpoint
from .local_files import WHOLE, LocalFolder, node_folder, part_name
from .stateful import ModelState, OptimizerState, Stateful, loading

log = logging.getLogger("qgtrain")
WHOLE_PARTS = frozenset({"model", "optimizer", "ema"})  # under ddp, the same on every rank


@dataclass(frozen=True)
class Transfer:
    part: str
    sender: int
    receiver: int


@dataclass(frozen=True)
class RestorePlan:
    """The step every rank restores, and the parts that travel: a part its rank lost (from the
    replica on the next node), the whole model where a node lost its own."""

    step: int
    transfers: tuple[Transfer, ...]


@dataclass(frozen=True)
class LocalCheckpoint:
    """What this rank restores from the local tier: its states by part name."""

    path: Path  # this node's folder of the step, for messages
    step: int
    states: dict[str, Any]
    fetched: tuple[str, ...]  # the parts that came from another node


class LocalTier:
    def __init__(
        self,
        folder: LocalFolder,
        env: DistEnv,
        cfg: CheckpointConfig,
        by_shards: bool,
        timeout_s: float,
    ) -> None:
        """`timeout_s` bounds each of the tier's collectives (train.collective_timeout_s): a rank
        cut off in a save or a start does not hold the others for gloo's half hour."""
        self.folder, self.env, self.by_shards = folder, env, by_shards
        self.cadence, self.keep = LocalCadence.of(cfg, env.world_size), cfg.local_keep
        world, per_node = env.world_size, env.local_world_size
        replicated = bool(cfg.local_replicas) and env.num_nodes > 1
        # the same local rank on the next node keeps this rank's replica; on the one before, ours
        self.neighbour = (env.rank + per_node) % world if replicated else None
        self.replica_of = (env.rank - per_node) % world if replicated else None
        self.writes_whole = not by_shards and env.local_rank == 0
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    @property
    def copies_state(self) -> bool:
        """Whether this rank's part holds the model's state: its shards, or its node's whole
        model (ddp's local rank 0)."""
        return self.by_shards or self.writes_whole

    def split(self, states: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(this rank's part, the whole model this rank writes or None) from the parts' states."""
        whole = {n: s for n, s in states.items() if n in WHOLE_PARTS and not self.by_shards}
        own = {n: _plain(s) for n, s in states.items() if n not in whole}
        return own, (whole if self.writes_whole else None)

    def save(self, step: int, own: dict[str, Any], whole: dict[str, Any] | None) -> None:
        """write, then spread (every rank calls this)."""
        self.spread(step, self.write(step, own, whole))

    def write(self, step: int, own: dict[str, Any], whole: dict[str, Any] | None) -> bool:
        """This rank's part (and its node's whole model) into its folder: the part of a save the
        step waits for when it is not asynchronous. Returns whether the part was written."""
        name = part_name(self.env.rank)
        wrote = self._attempt(f"write {name}", self.folder.write, step, name, own)
        if whole is not None:
            self._attempt("write the whole model", self.folder.write, step, WHOLE, whole)
        return wrote

    def spread(self, step: int, wrote: bool) -> None:
        """Send this rank's part to the next node and keep the one before's, then rotate once every
        rank is done (collectives of the tier's group)."""
        if self.neighbour is not None and self.replica_of is not None:
            replica = part_name(self.replica_of)
            staged = self.folder.staged(step, replica, self.env.rank)
            sent = self.folder.part(step, part_name(self.env.rank)) if wrote else None
            if transfer.exchange(sent, self.neighbour, self.replica_of, staged, self.group):
                self._attempt(f"keep {replica}", self.folder.commit, step, replica, staged)
        dist.barrier(group=self.group)
        if self.env.local_rank == 0:  # as the shared tier's rotation: a failure is a warning
            try:
                self.folder.keep_newest(self.keep)
            except OSError as exc:
                log.warning(
                    "could not rotate node-local checkpoints in %s: %s", self.folder.path, exc
                )

    def _attempt(self, what: str, write: Any, *args: Any) -> bool:
        try:
            write(*args)
            return True
        except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as RuntimeError
            log.warning(
                "node-local checkpoint: could not %s into %s (%s); the shared tier stays the "
                "fallback",
                what,
                self.folder.path,
                exc,
            )
            return False

    def newest(self, after: int) -> LocalCheckpoint | None:
        """The newest step past `after` (the shared tier's) every rank can restore from this tier,
        fetched; None if there is none (a collective of every rank)."""
        found = self._holdings()
        reports = objects.all_gather(
            {"node": self.env.node_rank, "local_rank": self.env.local_rank, "holds": found},
            self.group,
            "node-local checkpoints",
        )
        plan = choose(reports, self.env.world_size, not self.by_shards, after)
        return self._fetch(plan) if plan is not None else None

    def _holdings(self) -> dict[int, list[str]]:
        """The parts this rank holds a good copy of, by step; one line for each one passed over."""
        names = [part_name(self.env.rank)]
        names += [part_name(self.replica_of)] if self.replica_of is not None else []
        names += [WHOLE] if self.writes_whole else []
        holds: dict[int, list[str]] = {}
        for step in self.folder.steps():
            for name in names:
                problem = self.folder.problem(step, name)
                if problem is None:
                    holds.setdefault(step, []).append(name)
                else:
                    log.warning("passing over a node-local checkpoint file: %s", problem)
        return holds

    def _fetch(self, plan: RestorePlan) -> LocalCheckpoint:
        """Bring this rank what it lacks (kept in its folder again), then read its states."""
        step, received = plan.step, []
        for move in plan.transfers:  # the same order on every rank: no rank waits on a cycle
            if move.sender == self.env.rank:
                transfer.send(self.folder.part(step, move.part), move.receiver, self.group)
            if move.receiver == self.env.rank:
                staged = self.folder.staged(step, move.part, self.env.rank)
                transfer.receive(move.sender, staged, self.group)
                self.folder.commit(step, move.part, staged)
                received.append(move.part)
        wanted = [part_name(self.env.rank)] + ([WHOLE] if not self.by_shards else [])
        states: dict[str, Any] = {}
        for name in wanted:
            states.update(_loaded(self.folder.part(step, name)))
        return LocalCheckpoint(self.folder.step(step), step, states, tuple(received))


def restore(
    local: LocalCheckpoint, parts: Mapping[str, Stateful], run_id: str, by_shards: bool
) -> None:
    """Every part its state from `local`, in the order registered (as named.load does for the
    shared tier); a sharded model's weights and optimizer go back into the same shards, its EMA
    into its averages in place."""
    states = local.states
    with loading(Checkpoint(local.path, local.step, run_id, None, {})):
        for name, part in parts.items():
            if name not in WHOLE_PARTS or not by_shards:
                part.load_state_dict(states.get(name, {}))
            elif name == "model":
                optimizer = parts.get("optimizer")
                if not isinstance(part, ModelState) or not isinstance(optimizer, OptimizerState):
                    raise AssertionError("a sharded model's weights and optimizer come together")
                sharded.load_own_shards(
                    part.model, optimizer.optimizer, states["model"], states["optimizer"]
                )
            elif name == "ema":
                sharded.fill_own_shards(part.state_dict(), states.get("ema", {}))


def described(local: LocalCheckpoint) -> str:
    """How the log names a resume from this tier."""
    fetched = f"; {', '.join(local.fetched)} from another node's copy" if local.fetched else ""
    return f" (node-local tier{fetched})"


def opened(
    cfg: CheckpointConfig,
    env: DistEnv,
    run_id: str,
    by_shards: bool,
    strategy: str,
    timeout_s: float,
) -> LocalTier:
    """This node's tier of the run (a collective: a folder refused on one node stops every rank);
    its parts are read back only by a start of the same layout."""
    layout = f"{env.world_size} ranks, {env.local_world_size} per node, {strategy}"
    folder, failure = distributed.attempt(lambda: node_folder(cfg.local_dir, run_id, layout))
    distributed.fail_together(failure, "node-local folder")
    return LocalTier(folder, env, cfg, by_shards, timeout_s)


def choose(
    reports: list[dict[str, Any]], world_size: int, whole: bool, after: int
) -> RestorePlan | None:
    """The newest step past `after` whose every part some rank holds (and, under ddp, `whole`, the
    whole model), and the transfers that bring each rank what it lacks: its own part from whoever
    keeps its replica, the whole model from another node where its node has none. Every rank
    computes the same plan from the same reports."""
    held: dict[int, dict[str, list[int]]] = {}
    for rank, report in enumerate(reports):
        for step, names in report["holds"].items():
            for name in names:
                held.setdefault(int(step), {}).setdefault(name, []).append(rank)
    whole_of_node = {r["node"]: i for i, r in enumerate(reports) if r["local_rank"] == 0}
    for step in sorted((s for s in held if s > after), reverse=True):
        holders = held[step]
        needed = [part_name(r) for r in range(world_size)] + ([WHOLE] if whole else [])
        if not all(holders.get(name) for name in needed):
            continue
        transfers = [
            Transfer(part_name(r), holders[part_name(r)][0], r)
            for r in range(world_size)
            if r not in holders[part_name(r)]
        ]
        if whole:
            transfers += [
                Transfer(WHOLE, holders[WHOLE][0], r)
                for r, report in enumerate(reports)
                if whole_of_node.get(report["node"]) not in holders[WHOLE]
            ]
        return RestorePlan(step, tuple(transfers))
    return None


def _plain(state: Any) -> Any:
    """A state with each shard (DTensor) as the plain tensor this rank holds: the local tier is
    read back on the same ranks, into the same shards."""
    if (shard := sharded.shard_of(state)) is not None:
        return shard.to_local()
    if isinstance(state, str):
        return str(state)  # torch.__version__ is a str of its own class, which weights_only refuses
    if isinstance(state, dict):
        return {key: _plain(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_plain(value) for value in state)
    return state


def _loaded(path: Path) -> dict[str, Any]:
    """A part's states, read as tensors and plain data only: a part is never run as code."""
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        if isinstance(loaded, dict):
            return loaded
        why = f"it holds a {type(loaded).__name__}"
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
        why = first_line(exc, 200)
    raise CheckpointError(
        f"{path} passed its checksum but cannot be read as tensors ({why}). HINT: remove "
        "checkpoint.local_dir's folder of this run to resume from the shared tier"
    )
