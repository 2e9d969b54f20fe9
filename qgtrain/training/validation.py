"""Validation and test as the loop runs them: on the user's module, timed for the deadline, and
early stopping decided on rank 0 from the all-reduced metric and broadcast, so every rank stops
together."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..config import EarlyStoppingConfig
from ..data.loaders import Loaders
from ..evals.downstream import Downstream
from ..foundation.errors import ConfigError
from ..foundation.task import ReadyTask
from ..runtime import distributed
from ..runtime.rendezvous import DistEnv
from ..state.train_state import TrainState, metric_value
from .evaluation import decide_early_stop, evaluate
from .parallel.step import ParallelModel
from .parallel.strategy import Strategy
from .timing import StepTimer

# puts the weights to evaluate in the model while it is open (the EMA's)
WeightsInUse = Callable[[], contextlib.AbstractContextManager[Any]]


class Validator:
    def __init__(
        self,
        parallel: ParallelModel,
        task: ReadyTask,
        loaders: Loaders,
        early_stopping: EarlyStoppingConfig,
        eval_batches: int,
        precision: str,
        env: DistEnv,
        device: torch.device,
        timer: StepTimer,
        weights: WeightsInUse | None = None,
        every: int = 0,
        downstream: Downstream | None = None,
    ) -> None:
        """`weights`: what puts the weights to evaluate in the model and takes them out again (the
        EMA's, train.eval_ema); none: the training weights as they are. `every`: train.eval_every,
        the steps between validations (0 = only the final one). `downstream`: eval.tasks, scored
        at every validation."""
        self.parallel, self.task, self.loaders, self.early_stopping = (
            parallel,
            task,
            loaders,
            early_stopping,
        )
        self.eval_batches, self.precision, self.env, self.device, self.timer = (
            eval_batches,
            precision,
            env,
            device,
            timer,
        )
        self.weights, self.every = weights or contextlib.nullcontext, every
        self.downstream = downstream

    def due(self, step: int) -> bool:
        """Whether step `step` ends with a validation (the last step's final one is not this
        cadence's: the run's end does it); a function of the step, the same on every rank."""
        return bool(self.every) and step % self.every == 0

    def validate(self, state: TrainState) -> bool:
        """Evaluate the validation split; whether early stopping says stop (the same on every
        rank)."""
        es = self.early_stopping
        state.val_metrics = self._evaluate(self.loaders.val, self.eval_batches)
        state.eval_metrics = self._downstream(state.step)
        name = es.metric.removeprefix("val_")
        watched = es.metric.startswith("val_")
        if watched and self.loaders.val is not None and name not in state.val_metrics:
            raise ConfigError(
                f"early_stopping.metric: {es.metric} is not reported by the task (it reports "
                f"{', '.join('val_' + n for n in state.val_metrics)}); name one of those"
            )
        decision = (
            decide_early_stop(
                es, metric_value(state, es.metric), state.best_metric, state.evals_since_best
            )
            if self.env.is_main
            else None
        )
        state.best_metric, state.evals_since_best, stop = distributed.broadcast_from_main(decision)
        return bool(stop)

    def _downstream(self, step: int) -> dict[str, float | None]:
        if self.downstream is None:
            return {}
        started = time.perf_counter()
        self.parallel.agree_before_evaluation()
        with self.weights():
            metrics = self.downstream.evaluate(step)
        self.timer.downstream_done(started)
        return metrics

    def test(self, state: TrainState) -> None:
        state.test_metrics = self._evaluate(self.loaders.test, 0, test=True)

    def _evaluate(
        self, loader: Any, max_batches: int, test: bool = False
    ) -> dict[str, float | None]:
        if loader is None:
            return {}
        started = time.perf_counter()
        parallel = self.parallel
        metrics = split_figures(
            parallel.model,
            parallel.wrapped,
            parallel.strategy,
            self.task,
            loader,
            self.precision,
            self.device,
            max_batches,
            self.weights,
        )
        self.timer.evaluated(started, min(len(loader), max_batches or len(loader)), test)
        return metrics


def split_figures(
    model: nn.Module,
    wrapped: nn.Module,
    strategy: Strategy,
    task: ReadyTask,
    loader: Any,
    precision: str,
    device: torch.device,
    max_batches: int = 0,
    weights: WeightsInUse = contextlib.nullcontext,
) -> dict[str, float | None]:
    """The task's loss and metrics over `loader` (its first `max_batches` per rank; 0: all) with
    `weights` in the model, the same on every rank: by the loop, and by `qgtrain eval` on a
    checkpoint or an export (ops/eval_figures.py), so both give the same figures from the same
    weights. A collective."""
    strategy.agree_before_evaluation(model, wrapped)  # what the saved model gives, on every rank
    with weights():
        return evaluate(
            model,
            loader,
            task.loss,
            task.metrics,
            device,
            strategy.autocast_precision(precision),
            max_batches,
            lockstep=strategy.evaluates_in_lockstep,
        )
