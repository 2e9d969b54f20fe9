"""Datasets and loaders: sharded across ranks, resumable at any sample position without replaying
batches.

The data position of a run is one number per epoch: how many samples all ranks together have
consumed. The sampler is torch's DistributedSampler (rank r takes every world_size-th index of the
epoch's permutation), so after k samples per rank exactly the first k * world_size indices are used,
whatever the world size: a position can be resumed directly, and re-sharded when it divides by the
new world size. A training split that is a stream (an IterableDataset) is read through torchdata's
StatefulDataLoader instead and resumed by its state (streams.py).
"""

from __future__ import annotations

import datetime
import signal
import warnings
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from ..config import RunConfig
from ..foundation.errors import ConfigError
from ..foundation.task import ReadyTask
from ..runtime.rendezvous import DistEnv
from .stream.dispatch import DispatchedBatches
from .stream.kinds import for_this_rank, is_stream
from .stream.streams import Position, StreamBatches


@dataclass(frozen=True)
class Loaders:
    sampler: ResumableSampler | None  # None for a stream
    train: DataLoader[Any]
    val: DataLoader[Any] | None
    test: DataLoader[Any] | None
    seed: int = 0  # of the training loader
    label: str = "the task's train split"  # in messages about it
    dispatch: bool = False  # data.dispatch: rank 0 reads the stream and sends each rank its batches


def loaders_for(task: ReadyTask, cfg: RunConfig, env: DistEnv, device: torch.device) -> Loaders:
    """The task's loaders from the run's train and data sections."""
    return build_loaders(
        task.train,
        task.val,
        task.test,
        task.collate,
        env,
        batch_size=cfg.train.batch_size,
        num_workers=cfg.data.num_workers,
        device=device,
        seed=cfg.train.seed,
        label=f"task.factory: the train split of {cfg.task.factory}",
        dispatch=cfg.data.dispatch,
    )


def build_loaders(
    train: Any,
    val: Any,
    test: Any,
    collate: Callable[[list[Any]], Any],
    env: DistEnv,
    batch_size: int,
    num_workers: int,
    device: torch.device,
    seed: int,
    label: str = "the task's train split",
    dispatch: bool = False,
) -> Loaders:
    """Training batches in a resumable shuffled order (full batches only, so every rank takes the
    same number of steps); validation and test batches each sample exactly once over all ranks."""

    def evaluation(split: Any) -> DataLoader[Any] | None:
        if split is None:
            return None
        return make_loader(
            split, EvalShard(split, env), batch_size, num_workers, device, seed, False, collate
        )

    if is_stream(train):
        part = train if dispatch else for_this_rank(train, env.rank, env.world_size)
        stream = stream_loader(part, batch_size, num_workers, device, seed + env.rank, collate)
        label = getattr(train, "stream_label", label)  # a stream of qgtrain's names its source
        return Loaders(
            None, stream, evaluation(val), evaluation(test), seed + env.rank, label, dispatch
        )
    if dispatch:
        raise ConfigError(
            f"data.dispatch: {label} is map-style (len and indexing), which every "
            "rank reads its own shard of by index; dispatch is for a stream (an "
            "IterableDataset, or data.mix). HINT: set data.dispatch: false"
        )
    sampler = ResumableSampler(train, env, seed, shuffle=True, drop_last=True)
    if len(sampler) < batch_size:
        raise ConfigError(
            f"train.batch_size: the training split has {len(train)} samples: too "
            f"few for {env.world_size} rank(s) x train.batch_size={batch_size}"
        )
    return Loaders(
        sampler,
        make_loader(
            train, sampler, batch_size, num_workers, device, seed + env.rank, True, collate
        ),
        evaluation(val),
        evaluation(test),
    )


def train_batches(
    loaders: Loaders, samples_per_micro_batch: int, timeout_s: float
) -> TrainBatches | StreamBatches | DispatchedBatches:
    """The training batches of a run: by sampler for map-style data, by stream otherwise. A stream's
    ranks agree each step on a gloo group of their own (every rank calls this, in the same
    order)."""
    if loaders.sampler is not None:
        return TrainBatches(loaders, samples_per_micro_batch)
    group = None
    if dist.is_initialized() and dist.get_world_size() > 1:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    kind = DispatchedBatches if loaders.dispatch else StreamBatches
    return kind(loaders.train, samples_per_micro_batch, loaders.seed, loaders.label, group)


class TrainBatches:
    """Training micro-batches forever, across epochs, from a data position the caller keeps.

    `position` is the run's (epoch, samples of all ranks in that epoch); `next` advances it by one
    micro-batch of every rank, and starts the next epoch when the loader runs out, so the position a
    checkpoint saves is always the one the next batch starts from.
    """

    def __init__(self, loaders: Loaders, samples_per_micro_batch: int) -> None:
        assert loaders.sampler is not None
        self.loader, self.sampler, self.samples = (
            loaders.train,
            loaders.sampler,
            samples_per_micro_batch,
        )
        self._batches: Iterator[Any] | None = None

    def step(self, position: Position, micro_batches: int) -> list[Any]:
        return [self.next(position) for _ in range(micro_batches)]

    def saved(self) -> None:
        """The position is the run's own (position): nothing of the loader's to save."""
        return None

    def restore(self, saved: Any, checkpoint: Any) -> None:
        pass

    def next(self, position: Position) -> Any:
        if self._batches is None:
            self.sampler.set_position(position.epoch, position.samples_in_epoch)
            self._batches = iter(self.loader)
        try:
            batch = next(self._batches)
        except StopIteration:  # the epoch is over
            position.epoch, position.samples_in_epoch = position.epoch + 1, 0
            self.sampler.set_epoch(position.epoch)
            self._batches = iter(self.loader)
            batch = next(self._batches)
        position.samples_in_epoch += self.samples
        return batch

    def between(self, start: tuple[int, int], end: tuple[int, int]) -> int:
        """Micro-batches drawn from data position `start` to `end`, each (epoch, samples in it)."""
        per_epoch = self.sampler.num_samples // (self.loader.batch_size or 1) * self.samples
        return ((end[0] - start[0]) * per_epoch + end[1] - start[1]) // self.samples


class ResumableSampler(DistributedSampler[Any]):
    """DistributedSampler that can begin part-way through an epoch by slicing, not by replaying
    batches."""

    def __init__(
        self, dataset: Dataset[Any], env: DistEnv, seed: int, shuffle: bool, drop_last: bool
    ) -> None:
        super().__init__(
            dataset,
            num_replicas=env.world_size,
            rank=env.rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = 0

    def set_position(self, epoch: int, samples_consumed: int) -> None:
        """Continue epoch `epoch` after `samples_consumed` samples of all ranks together, a multiple
        of the world size (train_state.restore refuses a checkpoint whose position is not)."""
        super().set_epoch(epoch)
        self.start = samples_consumed // self.num_replicas

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        return iter(indices[self.start :])

    def __len__(self) -> int:
        return max(self.num_samples - self.start, 0)


class EvalShard(Sampler[int]):
    """Rank r evaluates samples r, r + W, r + 2W, ...: every sample exactly once, so shards may be
    uneven."""

    def __init__(self, dataset: Sized, env: DistEnv) -> None:
        self.indices = range(env.rank, len(dataset), env.world_size)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def make_loader(
    dataset: Dataset[Any],
    sampler: Sampler[Any],
    batch_size: int,
    num_workers: int,
    device: torch.device,
    seed: int,
    drop_last: bool,
    collate: Callable[[list[Any]], Any] | None = None,
) -> DataLoader[Any]:
    """A loader whose iterator never draws from the global RNG, so resuming leaves the RNG stream
    intact."""
    return DataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        collate_fn=collate,
        pin_memory=device.type == "cuda",
        drop_last=drop_last,
        persistent_workers=num_workers > 0,
        worker_init_fn=ignore_stop_signals,
        generator=torch.Generator().manual_seed(seed),
    )


def stream_loader(
    dataset: Any,
    batch_size: int,
    num_workers: int,
    device: torch.device,
    seed: int,
    collate: Callable[[list[Any]], Any] | None,
) -> DataLoader[Any]:
    """torchdata's StatefulDataLoader over a stream: full batches only (a rank's count of samples is
    its count of batches), and workers started afresh each epoch, so that each takes the dataset as
    set_epoch left it (persistent workers keep the copy they were started with)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which torch deprecates
        warnings.filterwarnings("ignore", "'set_vital' is deprecated")
        loader: DataLoader[Any] = StatefulDataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=num_workers,
            collate_fn=collate,
            pin_memory=device.type == "cuda",
            drop_last=True,
            persistent_workers=False,
            worker_init_fn=ignore_stop_signals,
            generator=torch.Generator().manual_seed(seed),
        )
    return loader


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers leave stopping to their rank.

    Slurm signals every process of a step when it preempts, cancels or warns of the time limit,
    workers included, and torch's workers die of SIGTERM; the rank would then see a crashed worker
    instead of taking the agreed checkpoint. A worker still ends when its rank shuts it down or
    dies.
    """
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
