"""Model factories for tests, named in configs as 'tests.factories:<function>' like a user's own."""

from __future__ import annotations

import os
import signal

import torch
import torch.distributed as dist
from huggingface_hub import PyTorchModelHubMixin
from torch import nn


class TinyLM(nn.Module):
    """Embedding, one hidden layer, vocabulary head: enough to learn, cheap enough for many
    processes."""

    def __init__(self, vocab_size: int, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(input_ids))))


def tiny(vocab_size: int, seq_len: int) -> nn.Module:
    return TinyLM(vocab_size)


class WithUnusedHead(TinyLM):
    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.unused_head = nn.Linear(32, 4)


def with_unused_head(vocab_size: int, seq_len: int) -> nn.Module:
    return WithUnusedHead(vocab_size)


class NanOnRankOneAtStepThree(TinyLM):
    """Produces a NaN loss on rank 1 only, in its third training forward pass."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.calls = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = super().forward(input_ids)
        if self.training:
            self.calls += 1
            if dist.get_rank() == 1 and self.calls == 3:
                return logits * float("nan")
        return logits


def nan_on_rank_one_at_step_three(vocab_size: int, seq_len: int) -> nn.Module:
    return NanOnRankOneAtStepThree(vocab_size)


class TinyHubLM(TinyLM, PyTorchModelHubMixin):
    """A user model made exportable the huggingface_hub way: its init arguments are saved with
    it."""

    def __init__(self, vocab_size: int = 257, width: int = 32) -> None:
        super().__init__(vocab_size, width)


def tiny_hub(vocab_size: int, seq_len: int) -> nn.Module:
    return TinyHubLM(vocab_size)


class SometimesUnused(TinyLM):
    """Uses its extra layer on odd training steps only: what find_unused_parameters exists for."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.extra = nn.Linear(32, 32)
        self.calls = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.hidden(self.embed(input_ids)))
        if self.training:
            self.calls += 1
            if self.calls % 2:
                hidden = hidden + self.extra(hidden)
        return self.head(hidden)


def sometimes_unused(vocab_size: int, seq_len: int) -> nn.Module:
    return SometimesUnused(vocab_size)


class OutOfMemoryAtStepTwo(TinyLM):
    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.calls = 0

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == 2:  # what the CUDA caching allocator raises; no GPU here to exhaust
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().forward(input_ids)


def out_of_memory_at_step_two(vocab_size: int, seq_len: int) -> nn.Module:
    return OutOfMemoryAtStepTwo(vocab_size)


class WorkerDies(torch.utils.data.Dataset):
    """Random tokens; the DataLoader worker that loads sample 40 is killed, as the OOM killer or a
    bus error on a full /dev/shm would kill it."""

    def __len__(self) -> int:
        return 256

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 40 and torch.utils.data.get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.randint(0, 257, (16,), generator=torch.Generator().manual_seed(index))


def data_with_dying_worker(seq_len: int, seed: int) -> tuple:
    return WorkerDies(), WorkerDies(), WorkerDies(), 257


class DriftsApart(TinyLM):
    """A frozen scale that each rank changes in place differently: replicas silently diverge."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.scale.add_(0.1 * (dist.get_rank() + 1))
        return super().forward(input_ids) * self.scale


def drifts_apart(vocab_size: int, seq_len: int) -> nn.Module:
    return DriftsApart(vocab_size)


# A poisoned sample for the loss-spike tests (test_spikes.py): with 2 ranks, train.batch_size 4 and
# train.seed's shuffle of epoch 0, the sample at position POISON_AT of the permutation is the second
# of rank 1's batch at step 13 (rank r takes positions r, r + 2, ...; DistributedSampler's
# permutation).
POISON_AT, POISON_TOKEN = 2 * (12 * 4 + 1) + 1, 256


class Poisoned(torch.utils.data.Dataset):
    """Learnable sequences of tokens below 256; one sample is all POISON_TOKEN."""

    def __init__(self, samples: int, seq_len: int, seed: int, poisoned: int | None) -> None:
        from qgtrain.data.tokens import SyntheticTokens

        self.clean, self.seq_len, self.poisoned = (
            SyntheticTokens(samples, seq_len, 256, seed),
            seq_len,
            poisoned,
        )

    def __len__(self) -> int:
        return len(self.clean)

    def __getitem__(self, index: int) -> torch.Tensor:
        return (
            torch.full((self.seq_len,), POISON_TOKEN)
            if index == self.poisoned
            else self.clean[index]
        )


def poisoned_data(seq_len: int, seed: int) -> tuple:
    order = torch.randperm(256, generator=torch.Generator().manual_seed(seed)).tolist()
    return (
        Poisoned(256, seq_len, seed, order[POISON_AT]),
        Poisoned(16, seq_len, seed + 1, None),
        Poisoned(16, seq_len, seed + 2, None),
        257,
    )


class SpikesOnPoison(TinyLM):
    """With dropout (a forward draws random numbers); a training batch that holds the poison token
    gets a loss some thousand times its usual size, finite, as a corrupt sample might."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.dropout = nn.Dropout(0.1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.dropout(torch.tanh(self.hidden(self.embed(input_ids)))))
        if self.training:
            return logits * torch.where((input_ids == POISON_TOKEN).any(), 1e4, 1.0)
        return logits


def spikes_on_poison(vocab_size: int, seq_len: int) -> nn.Module:
    return SpikesOnPoison(vocab_size)


# A run whose batches turn poisonous at SPIKE_STEP (poisoned_data, spikes_on_poison).
SPIKE_STEP, MAX_STEPS = 13, 16
POISONED = [
    "data.name=factory",
    "data.factory=tests.factories:poisoned_data",
    "train.eval_every=0",
    "model.factory=tests.factories:spikes_on_poison",
    f"train.max_steps={MAX_STEPS}",
    "train.eval_batches=1",
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=5",
]
