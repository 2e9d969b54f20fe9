"""Datasets and loaders: sharded across ranks, resumable at any sample position without replaying batches.

The data position of a run is one number per epoch: how many samples all ranks together have consumed.
The sampler is torch's DistributedSampler (rank r takes every world_size-th index of the epoch's
permutation), so after k samples per rank exactly the first k * world_size indices are used, whatever the
world size: a position can be resumed directly, and re-sharded when it divides by the new world size.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from ..config import DataConfig
from ..errors import CheckpointError, ConfigError
from ..factory import load_factory
from ..runtime.rendezvous import DistEnv
from . import corpus


class TokenWindows(Dataset[torch.Tensor]):
    """Non-overlapping windows of seq_len tokens from a memory-mapped token file."""

    def __init__(self, path: str, dtype: str, seq_len: int) -> None:
        self.path, self.dtype, self.seq_len = path, dtype, seq_len
        self._tokens: np.ndarray | None = None  # opened lazily: a memmap must not be pickled into workers
        self._length = np.memmap(path, dtype=dtype, mode="r").shape[0] // seq_len

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> torch.Tensor:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = index * self.seq_len
        return torch.from_numpy(self._tokens[start:start + self.seq_len].astype(np.int64))


class SyntheticTokens(Dataset[torch.Tensor]):
    """Learnable random sequences (each token is the previous one plus a per-sample stride), for tests."""

    def __init__(self, samples: int, seq_len: int, vocab_size: int, seed: int) -> None:
        self.samples, self.seq_len, self.vocab_size, self.seed = samples, seq_len, vocab_size, seed

    def __len__(self) -> int:
        return self.samples

    def __getitem__(self, index: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        start, stride = torch.randint(0, self.vocab_size, (2,), generator=gen).tolist()
        return (start + (stride % 7 + 1) * torch.arange(self.seq_len)) % self.vocab_size


@dataclass(frozen=True)
class Splits:
    train: Dataset[Any]
    val: Dataset[Any]
    test: Dataset[Any]
    vocab_size: int


def build_splits(data: DataConfig, prepared: corpus.TokenFiles | None, seed: int) -> Splits:
    """The three splits named by data.name (the corpus must have been prepared on rank 0 first)."""
    if data.name == "corpus":
        assert prepared is not None
        windows = {split: TokenWindows(str(prepared.path(split)), prepared.dtype, data.seq_len)
                   for split in corpus.SPLITS}
        for split, dataset in windows.items():
            if split == "train" or getattr(data, f"{split}_fraction") > 0:
                if len(dataset) == 0:
                    raise ConfigError(f"data.corpus_mb: the {split} split has fewer than data.seq_len="
                                      f"{data.seq_len} tokens; use more text or a shorter seq_len")
        return Splits(windows["train"], windows["val"], windows["test"], prepared.vocab_size)
    if data.name == "synthetic":
        n_val = max(1, int(data.synthetic_samples * data.val_fraction))
        n_test = max(1, int(data.synthetic_samples * data.test_fraction))
        vocab = 257
        return Splits(SyntheticTokens(data.synthetic_samples, data.seq_len, vocab, seed),
                      SyntheticTokens(n_val, data.seq_len, vocab, seed + 1),
                      SyntheticTokens(n_test, data.seq_len, vocab, seed + 2), vocab)
    made = load_factory(str(data.factory), "data.factory")(seq_len=data.seq_len, seed=seed)
    if not (isinstance(made, tuple) and len(made) == 4):
        raise ConfigError(f"data.factory: {data.factory} must return (train, val, test, vocab_size), "
                          f"got {type(made).__name__}")
    return Splits(*made)


class ResumableSampler(DistributedSampler[Any]):
    """DistributedSampler that can begin part-way through an epoch by slicing, not by replaying batches."""

    def __init__(self, dataset: Dataset[Any], env: DistEnv, seed: int, shuffle: bool, drop_last: bool) -> None:
        super().__init__(dataset, num_replicas=env.world_size, rank=env.rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.start = 0

    def set_position(self, epoch: int, samples_consumed: int) -> None:
        """Continue epoch `epoch` after `samples_consumed` samples of all ranks together."""
        if samples_consumed % self.num_replicas:
            raise CheckpointError(
                f"the checkpoint stopped after {samples_consumed} samples of epoch {epoch}, which cannot be "
                f"split evenly over {self.num_replicas} ranks. HINT: resume with the world size it was saved "
                "with, or from a checkpoint at an epoch boundary")
        super().set_epoch(epoch)
        self.start = samples_consumed // self.num_replicas

    def __iter__(self) -> Iterator[Any]:
        indices = list(super().__iter__())
        return iter(indices[self.start:])

    def __len__(self) -> int:
        return max(self.num_samples - self.start, 0)


class EvalShard(Sampler[int]):
    """Rank r evaluates samples r, r + W, r + 2W, ...: every sample exactly once, so shards may be uneven."""

    def __init__(self, dataset: Dataset[Any], env: DistEnv) -> None:
        self.indices = range(env.rank, len(dataset), env.world_size)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


def make_loader(dataset: Dataset[Any], sampler: Sampler[Any], batch_size: int, num_workers: int,
                device: torch.device, seed: int, drop_last: bool) -> DataLoader[Any]:
    """A loader whose iterator never draws from the global RNG, so resuming leaves the RNG stream intact."""
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=num_workers,
                      pin_memory=device.type == "cuda", drop_last=drop_last,
                      persistent_workers=num_workers > 0, worker_init_fn=ignore_stop_signals,
                      generator=torch.Generator().manual_seed(seed))


def ignore_stop_signals(worker_id: int) -> None:
    """DataLoader workers leave stopping to their rank.

    Slurm signals every process of a step when it preempts, cancels or warns of the time limit, workers
    included, and torch's workers die of SIGTERM; the rank would then see a crashed worker instead of
    taking the agreed checkpoint. A worker still ends when its rank shuts it down or dies.
    """
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
