"""A Trainer built in the test's own process from plain parts: a model, a list of samples and a
loss, with qgtrain's real loaders, checkpointer, metrics log and stop flag around them. The loop's
phases are then tested one by one without starting ranks; its collectives run on a one-rank gloo
group over an in-memory store, so nothing listens on a port and nothing is left behind."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from qgtrain.config import RunConfig
from qgtrain.config.load import load_config
from qgtrain.foundation.task import ReadyTask
from qgtrain.runtime import rng
from qgtrain.runtime.deadline import Deadline
from qgtrain.runtime.rendezvous import from_environ
from qgtrain.runtime.signals import StopFlag
from qgtrain.state.checkpointer import Checkpointer
from qgtrain.training.assembly import assemble
from qgtrain.training.metrics import MetricsLog
from qgtrain.training.optimizers import build_optimizer
from qgtrain.training.parallel.strategy import strategy_for
from qgtrain.training.parts import LoopParts, Settings
from qgtrain.training.profiling import StepProfiler
from qgtrain.training.trainer import Trainer

CPU = torch.device("cpu")
ONE_RANK = from_environ({})


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def config(*sets: str) -> RunConfig:
    return load_config(
        [],
        [
            "train.log_every=1",
            "train.eval_every=0",
            "checkpoint.every_steps=0",
            "logging.tensorboard=false",
            "optim.warmup_steps=0",
            "optim.schedule=constant",
            "early_stopping.patience=0",
            *sets,
        ],
    )


def linear_task(
    samples: int = 16, loss: Callable[[nn.Module, Any], torch.Tensor] | None = None
) -> ReadyTask:
    """y = x @ w on fixed random samples: a model whose gradients are easy to reason about."""
    rng.seed_everything(0)
    data = [(torch.randn(4), torch.randn(2)) for _ in range(samples)]

    def mse(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((model(x) - y) ** 2).mean()

    return ReadyTask(
        model=nn.Linear(4, 2),
        train=data,
        val=data[:4],
        collate=torch.utils.data.default_collate,
        loss=loss or mse,
    )


def build_trainer(
    run: Path, task: ReadyTask, cfg: RunConfig, stop: StopFlag | None = None
) -> Trainer:
    """What run.py's _trainer builds, with the task's model unwrapped (one rank: no DDP)."""
    from qgtrain.data.loaders import build_loaders

    run.mkdir(parents=True, exist_ok=True)
    loaders = build_loaders(
        task.train,
        task.val,
        task.test,
        task.collate,
        ONE_RANK,
        cfg.train.batch_size,
        0,
        CPU,
        cfg.train.seed,
    )
    checkpointer = Checkpointer(
        run / "checkpoints", "seam", ONE_RANK, dataclasses.replace(cfg.checkpoint, async_save=False)
    )
    metrics = MetricsLog(run, True, False, None)
    parallel = strategy_for(cfg.train, ONE_RANK, CPU).setup(
        task.model,
        False,
        "fp32",
        lambda: build_optimizer(task, cfg.optim, CPU),
        torch.amp.GradScaler("cpu", enabled=False),
    )
    parts = LoopParts(
        task,
        parallel,
        loaders,
        checkpointer,
        metrics,
        stop or StopFlag([]),
        Deadline(None, None, 0.0),
        StepProfiler((), run, 0, CPU, False),
    )
    settings = Settings(cfg.train, cfg.optim, cfg.early_stopping, "fp32")
    return Trainer(parts, settings, ONE_RANK, CPU, assemble(parts, settings, ONE_RANK, CPU))
