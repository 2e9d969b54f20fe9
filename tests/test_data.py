"""Sharding and resumable data positions. Runs against: real DataLoaders with worker processes; the
ranks' samplers are built from DistEnv values (no process group is needed to shard indices)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import Dataset

from qgtrain.config.load import load_config
from qgtrain.data.loaders import EvalShard, ResumableSampler, make_loader
from qgtrain.runtime.rendezvous import DistEnv
from tests.ranks import run_ranks, train_rank


class Indices(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index])


def loader(  # type: ignore[no-untyped-def]
    dataset: Dataset, rank: int, world: int, workers: int, batch: int = 4
):
    env = DistEnv(rank=rank, world_size=world)
    sampler = ResumableSampler(dataset, env, seed=5, shuffle=True, drop_last=True)
    return sampler, make_loader(
        dataset, sampler, batch, workers, torch.device("cpu"), seed=5, drop_last=True
    )


def epoch_batches(
    dataset: Dataset, rank: int, world: int, epoch: int, workers: int
) -> list[list[int]]:
    sampler, data = loader(dataset, rank, world, workers)
    sampler.set_epoch(epoch)
    return [b.flatten().tolist() for b in data]


@pytest.mark.parametrize("workers", [0, 2])
def test_resuming_mid_epoch_in_a_later_epoch_gives_the_same_next_batch_on_every_rank(workers):
    dataset, world, batch = Indices(203), 2, 4
    for rank in range(world):
        uninterrupted = epoch_batches(dataset, rank, world, epoch=1, workers=workers)
        consumed_batches = 7
        sampler, data = loader(dataset, rank, world, workers)
        sampler.set_position(epoch=1, samples_consumed=consumed_batches * batch * world)
        resumed = [b.flatten().tolist() for b in data]
        assert resumed[0] == uninterrupted[consumed_batches], f"rank {rank}"
        assert resumed == uninterrupted[consumed_batches:]


def test_consumed_samples_are_the_same_prefix_whatever_the_world_size():
    """Why a position can be re-sharded: k samples per rank use exactly the first k * world
    indices."""
    dataset = Indices(96)
    one = sum(epoch_batches(dataset, 0, 1, epoch=3, workers=0), [])
    for world in (2, 4):
        per_rank = [
            sum(epoch_batches(dataset, r, world, epoch=3, workers=0), []) for r in range(world)
        ]
        first_two_batches = sorted(i for rank in per_rank for i in rank[:8])
        assert first_two_batches == sorted(one[: 8 * world])


def test_a_position_that_does_not_divide_by_the_new_world_size_is_refused(tmp_path):
    """2 ranks x 4 samples: 8 samples into the epoch at step 1, which 3 ranks cannot continue
    exactly."""
    cfg = load_config(
        [],
        [
            "data.name=synthetic",
            "data.seq_len=16",
            "train.batch_size=4",
            "train.max_steps=1",
            "train.eval_every=0",
            "logging.tensorboard=false",
            "model.factory=tests.factories:tiny",
            "checkpoint.every_steps=1",
        ],
    )
    run = str(tmp_path / "run")
    assert [r["exit"] for r in run_ranks(2, train_rank, cfg, run)] == [0, 0]
    more = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, max_steps=2))
    for result in run_ranks(3, train_rank, more, run):
        assert result["exit"] == 2
        assert (
            "was saved by 2 rank(s) after 8 samples of epoch 0, which 3 ranks cannot split evenly"
            in result["error"]
        )


def test_evaluation_shards_cover_every_sample_exactly_once_however_uneven():
    dataset = Indices(11)
    shards = [list(EvalShard(dataset, DistEnv(rank=r, world_size=4))) for r in range(4)]
    assert sorted(i for shard in shards for i in shard) == list(range(11))
    assert [len(s) for s in shards] == [3, 3, 3, 2]


class CountingIndices(Indices):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.reads = 0

    def __getitem__(self, index: int) -> torch.Tensor:
        self.reads += 1
        return super().__getitem__(index)


def test_resuming_reads_only_the_batches_after_the_position():
    """No replay: reaching sample 190,000 of an epoch reads one batch, not the 190,000 before it."""
    dataset = CountingIndices(200_000)
    sampler, data = loader(dataset, 0, 2, 0)
    sampler.set_position(0, 190_000)
    first = next(iter(data))
    assert dataset.reads == 4 and first.numel() == 4
