"""Model factories for tests, named in configs as 'tests.factories:<function>' like a user's own."""

from __future__ import annotations

import torch
import torch.distributed as dist
from huggingface_hub import PyTorchModelHubMixin
from torch import nn


class TinyLM(nn.Module):
    """Embedding, one hidden layer, vocabulary head: enough to learn, cheap enough for many processes."""

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
    """A user model made exportable the huggingface_hub way: its init arguments are saved with it."""

    def __init__(self, vocab_size: int = 257, width: int = 32) -> None:
        super().__init__(vocab_size, width)


def tiny_hub(vocab_size: int, seq_len: int) -> nn.Module:
    return TinyHubLM(vocab_size)
