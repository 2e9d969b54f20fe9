"""Training batches from a stream (a task whose train split is an IterableDataset), resumed exactly.

A stream has no index to resume at: its position is what it has yielded. Each rank reads its own
part (the dataset shards itself by torch.distributed's rank and get_worker_info(); a Hugging Face
`datasets.IterableDataset` is split here with split_dataset_by_node) through torchdata's
StatefulDataLoader, whose state holds every worker's. A dataset with state_dict/load_state_dict
is put back from that state, saved in the rank's own checkpoint file; one without is read again
from the start of its epoch past the samples this rank had consumed (timed in the log), never
started over. A checkpoint of another world size hands every rank's state to a dataset with
load_merged (streamed data files: filestream.py; a mixture of them: mix.py), which deals the
positions again; any other stream resumes on the world size it was saved with.

Streams end unevenly across ranks and workers, and a rank that stepped alone would wait forever in
DDP's all-reduce. So every step the ranks agree (one small all-reduce on a gloo group of their own,
off the accelerator) whether any rank's stream has ended: then no rank takes that step, the epoch
counter advances, set_epoch(e) is called where the dataset has it, and every rank starts again;
or any rank failed to read (a bad record deep in a file): then every rank raises its error.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ...foundation.errors import ConfigError, QgtrainError
from ...runtime import distributed
from .kinds import is_stateful

log = logging.getLogger("qgtrain")


class Position(Protocol):
    epoch: int
    samples_in_epoch: int


class StreamBatches:
    """Training micro-batches of a stream across epochs, from a data position the caller keeps.

    The position is the run's (epoch, samples of all ranks in it), as for map-style data: every rank
    draws full batches in lockstep, so this rank has consumed samples_in_epoch / world_size of its
    stream. `label` names the split in messages (the task and its train split).
    """

    def __init__(
        self, loader: Any, samples_per_micro_batch: int, seed: int, label: str, group: Any
    ) -> None:
        self.loader, self.samples = loader, samples_per_micro_batch
        self.seed, self.label = seed, label
        self.group = group  # None: one rank, nothing to agree on
        self.stateful = is_stateful(loader.dataset)
        self._batches: Iterator[Any] | None = None
        self._pending: dict[str, Any] | None = None  # a restored position, taken by the first step
        self._resumed_from: Path | None = None
        self._consumed = 0  # this rank's samples in the current epoch
        self._epoch_samples: dict[int, int] = {}  # of all ranks, in each epoch that ended here

    def step(self, position: Position, micro_batches: int) -> list[Any]:
        """The next step's micro-batches; where any rank's stream ends first, the next epoch's."""
        while True:
            failure = None
            if self._batches is None and self._pending is not None:
                drawn = (
                    agreed(lambda: self._resume(position, micro_batches))
                    if self.group is not None
                    else self._resume(position, micro_batches)
                )
            else:
                if self._batches is None:
                    self._start(position.epoch)
                draw = lambda: self._draw(micro_batches)  # noqa: E731
                drawn, failure = (draw(), None) if self.group is None else distributed.attempt(draw)
            if not self._any_ended(drawn is None, failure):
                assert drawn is not None
                position.samples_in_epoch += micro_batches * self.samples
                self._consumed += micro_batches * self.loader.batch_size
                return drawn
            if position.samples_in_epoch == 0:
                raise ConfigError(
                    f"{self.label}: the stream ended before the first step of epoch "
                    f"{position.epoch} on at least one rank; every rank's part must yield at least "
                    f"{micro_batches} full batch(es) of train.batch_size="
                    f"{self.loader.batch_size} per epoch. HINT: check how the dataset splits "
                    "itself over ranks and workers (torch.distributed's rank, get_worker_info()) "
                    "and that it is not empty"
                )
            self._epoch_samples[position.epoch] = position.samples_in_epoch
            position.epoch, position.samples_in_epoch = position.epoch + 1, 0
            self._start(position.epoch)

    def saved(self) -> dict[str, Any]:
        """This rank's position in its stream, for its own checkpoint file (plain containers and
        tensors: loaded with weights_only)."""
        if self._pending is not None:  # restored, not yet read from: the same position
            return self._pending
        if self.stateful:
            return {"loader": copy.deepcopy(self.loader.state_dict())}
        return {"consumed": self._consumed}

    def restore(self, saved: dict[str, Any] | None, checkpoint: Path) -> None:
        """Resume at `saved` when the first step draws. A rollback restores a checkpoint while the
        iterator is running: it simply goes on, past the batches drawn since (rollback.py)."""
        if self._batches is not None:
            return
        if (
            saved is not None
            and "ranks" in saved
            and not callable(getattr(self.loader.dataset, "load_merged", None))
        ):
            raise ConfigError(
                f"{self.label}: {checkpoint} was saved by {len(saved['ranks'])} rank(s) reading "
                "a stream whose parts the ranks of this run cannot take over (it has no "
                "load_merged). HINT: resume with "
                f"{len(saved['ranks'])} ranks, or set checkpoint.resume: never"
            )
        wanted = (
            "ranks"
            if saved is not None and "ranks" in saved
            else "loader"
            if self.stateful
            else "consumed"
        )
        if saved is None or wanted not in saved:
            kind = "a stateful" if self.stateful else "a"
            raise ConfigError(
                f"{self.label}: {checkpoint} holds no position of {kind} stream "
                "for this rank (it was saved by a run with other training data). "
                "HINT: resume with the task it was trained with, or set "
                "checkpoint.resume: never"
            )
        self._pending, self._resumed_from = saved, checkpoint

    def between(self, start: tuple[int, int], end: tuple[int, int]) -> int:
        """Micro-batches drawn from data position `start` to `end`, each (epoch, samples in it), as
        far as the epochs that ended in this process tell."""
        whole = sum(self._epoch_samples.get(epoch, 0) for epoch in range(start[0], end[0]))
        return (whole + end[1] - start[1]) // self.samples

    def _start(self, epoch: int) -> None:
        """A new pass over the stream for `epoch`: its workers seeded from the run's seed and the
        epoch alone, so a resumed run seeds them as the uninterrupted one did."""
        set_epoch = getattr(self.loader.dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        self.loader.generator.manual_seed(self.seed * 1_000_003 + epoch)
        self._batches, self._consumed = iter(self.loader), 0

    def _draw(self, micro_batches: int) -> list[Any] | None:
        """The next micro-batches, or None where this rank's stream has ended (a part drawn is
        dropped: the step is taken by every rank or none)."""
        assert self._batches is not None
        drawn = []
        for _ in range(micro_batches):
            try:
                drawn.append(next(self._batches))
            except StopIteration:
                return None
            except ConfigError as exc:  # from a worker, with its traceback: its last line says it
                self._close()
                raise ConfigError(
                    str(exc).strip().splitlines()[-1].split("ConfigError: ", 1)[-1]
                ) from None
        return drawn

    def _close(self) -> None:
        """Shut the loader's workers down now: they ignore SIGTERM (loaders.ignore_stop_signals),
        which the interpreter's exit sends them, so the rank would wait for them forever."""
        shutdown = getattr(self._batches, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        self._batches = None

    def _resume(self, position: Position, micro_batches: int) -> list[Any] | None:
        pending, where = self._pending or {}, f"{self._resumed_from}"
        self._pending = None
        try:
            if "ranks" in pending:
                # saved by another world size: every rank's positions, dealt again (filestream.py)
                set_epoch = getattr(self.loader.dataset, "set_epoch", None)
                if callable(set_epoch):  # a mixture has none: it never ends
                    set_epoch(position.epoch)
                states = [
                    found
                    for rank in pending["ranks"]
                    for found in dataset_states((rank or {}).get("loader"))
                ]
                self.loader.dataset.load_merged(states)
                self.loader.generator.manual_seed(self.seed * 1_000_003 + position.epoch)
                self._batches = iter(self.loader)
                log.info(
                    "the stream's positions saved by %d rank(s) dealt again to this run's",
                    len(pending["ranks"]),
                )
            elif self.stateful:
                set_epoch = getattr(self.loader.dataset, "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(position.epoch)
                check_loads(self.loader.dataset, pending["loader"])
                self.loader.load_state_dict(pending["loader"])
                self._batches = iter(self.loader)
            else:
                self._start(position.epoch)
                self._skip(int(pending["consumed"]), where)
            self._consumed = position.samples_in_epoch * self.loader.batch_size // self.samples
            return self._draw(micro_batches)
        except QgtrainError:
            raise
        except Exception as exc:  # noqa: BLE001 a user's dataset raises bare Exceptions of any kind
            failure = last_line(exc)
        raise ConfigError(
            f"{self.label}: resuming the stream from {where} failed: {failure}. The checkpoint is "
            "unchanged. HINT: resume with the dataset, data.num_workers and world size it was "
            "saved with, or set checkpoint.resume: never"
        )

    def _skip(self, samples: int, where: str) -> None:
        """Read past what this rank had consumed in this epoch: a stream without state has no
        other way back to its position."""
        started, batch_size = time.perf_counter(), self.loader.batch_size
        assert self._batches is not None
        for index in range(samples // batch_size):
            try:
                next(self._batches)
            except StopIteration:
                raise ConfigError(
                    f"{self.label}: the stream ended after {index * batch_size} of the {samples} "
                    f"samples this rank had consumed when {where} was saved: it is not the stream "
                    "that was trained on. HINT: resume with the same dataset, data.num_workers and "
                    "world size, or set checkpoint.resume: never"
                ) from None
        log.info(
            "skipped %d samples of the stream in %.2f s (it has no state_dict: resumed by "
            "reading past what this rank had consumed)",
            samples,
            time.perf_counter() - started,
        )

    def _any_ended(self, ended: bool, failure: str | None = None) -> bool:
        """Whether any rank's stream ended; a rank's `failure` to read (distributed.attempt) is
        raised on every rank, so none waits for it in the next step's collectives."""
        if self.group is None:
            return ended
        flag = torch.tensor([2 if failure else int(ended)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if flag.item() == 2:
            distributed.fail_together(failure, "stream")
        return bool(flag.item())


def check_loads(dataset: Any, loader_state: dict[str, Any]) -> None:
    """Load each worker's saved dataset state into a copy of the dataset, here, before any worker
    starts: a worker whose start fails is never told to stop by the loader, and as it ignores
    SIGTERM (loaders.ignore_stop_signals) the rank could not exit. A dataset that cannot be copied
    is left to its workers."""
    try:
        trial = copy.deepcopy(dataset)
    except Exception:  # noqa: BLE001 copying a user's dataset raises bare Exceptions of any kind
        return
    for state in dataset_states(loader_state):
        trial.load_state_dict(copy.deepcopy(state))


def dataset_states(state: Any) -> list[Any]:
    """Every dataset state in a StatefulDataLoader's state: the main process's or each worker's."""
    if not isinstance(state, dict):
        return []
    own = [state["dataset_state"]] if state.get("dataset_state") is not None else []
    return own + [
        found
        for key, value in state.items()
        if key != "dataset_state"
        for found in dataset_states(value)
    ]


def last_line(exc: BaseException) -> str:
    """What went wrong in one line: a worker's error arrives with its traceback, whose last line
    names it."""
    lines = str(exc).strip().splitlines() or [""]
    name = type(exc).__name__
    return (lines[-1] if lines[-1].startswith(f"{name}:") else f"{name}: {lines[-1]}")[:300]


def agreed(work: Callable[[], Any]) -> Any:
    """work() on every rank; a QgtrainError on any rank is raised on all of them (the lowest
    rank's), so no rank waits in the next step's collectives for one that has gone."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return work()
    result, failure = distributed.attempt(work)
    distributed.fail_together(failure, "stream")
    return result
