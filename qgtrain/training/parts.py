"""What the training loop runs (its LoopParts, built by qgtrain/run.py; state/named.py's Parts are a
checkpoint's named states) and how it is set up (its settings, never the whole config); how it ends
is state/train_state.py's Outcome, saved with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from ..config import EarlyStoppingConfig, OptimConfig, RunConfig, TrainConfig
from ..data.loaders import Loaders
from ..evals.downstream import Downstream
from ..foundation.task import ReadyTask
from ..runtime.deadline import Deadline
from ..runtime.signals import StopFlag
from ..state.checkpointer import Checkpointer
from .goodput import Account
from .metrics import MetricsLog
from .parallel.step import ParallelModel
from .profiling import StepProfiler


@dataclass
class LoopParts:
    """What the loop runs. `parallel` is the task's model as its strategy set it up, with the
    optimizer and loss scaler (parallel/step.py): a step's backward, clip and update; the strategy
    (parallel.strategy) is asked wherever how the ranks hold the model matters."""

    task: ReadyTask
    parallel: ParallelModel
    loaders: Loaders
    checkpointer: Checkpointer
    metrics: MetricsLog
    stop: StopFlag
    deadline: Deadline  # rank 0's; the others follow its agreed decision
    profiler: StepProfiler
    downstream: Downstream | None = None  # eval.tasks, scored beside every validation
    account: Account | None = None  # rank 0's: where the run's time goes (goodput.py)


@dataclass(frozen=True)
class Settings:
    train: TrainConfig
    optim: OptimConfig
    early_stopping: EarlyStoppingConfig
    precision: str  # resolved: fp32, bf16 or fp16
    export_on_finish: bool = False  # part of the final work that must fit before the time limit

    @classmethod
    def of(cls, cfg: RunConfig, precision: str) -> Settings:
        """The loop's sections of the run's config, with the precision resolved for the device."""
        return cls(cfg.train, cfg.optim, cfg.early_stopping, precision, cfg.export.on_finish)


class StepResult(NamedTuple):
    step: int
    lr: float
    loss_sum: torch.Tensor  # this rank's mean loss over the micro-batches, on the device
    grad_norm: torch.Tensor
