"""Models, tasks and schedules for tests/test_optimizers.py, named in configs like a user's own."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from torch import nn

import qgtrain
from tests.factories import TinyLM
from tests.tasks import points

_calls = {"forward": 0}


def die_on_cue(model: nn.Module) -> None:
    """SIGKILL this rank at its QGTRAIN_TEST_KILL_AT-th training forward (unset: never)."""
    if model.training:
        _calls["forward"] += 1
        if _calls["forward"] == int(os.environ.get("QGTRAIN_TEST_KILL_AT", "0")):
            os.kill(os.getpid(), signal.SIGKILL)


class KillableLM(TinyLM):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        die_on_cue(self)
        return super().forward(input_ids)


def killable(vocab_size: int, seq_len: int) -> nn.Module:
    return KillableLM(vocab_size)


def own_optimizer(model: nn.Module, optim: Any) -> torch.optim.Optimizer:
    """SGD with momentum, the last layer at a tenth of the rate: per-layer rates, as tasks do."""
    return torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[3].parameters(), "lr": optim.lr / 10}],
        lr=optim.lr,
        momentum=0.9,
    )


def points_with_own_optimizer(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    task = points(cfg)
    loss = task.loss
    assert loss is not None

    def killable_loss(model: nn.Module, batch: Any) -> Any:
        die_on_cue(model)
        return loss(model, batch)

    task.loss, task.optimizer = killable_loss, own_optimizer
    return task


def halving(step: int, max_steps: int, optim: Any) -> float:
    """A schedule of one's own: the rate halves every quarter of the run."""
    return float(optim.lr * 0.5 ** (4 * step // max_steps))
