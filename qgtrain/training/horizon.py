"""The learning rate of each step, and the guard on a changed train.max_steps when a run resumes.

A checkpoint records the horizon it was trained toward (TrainState.max_steps). A resume toward
another one must not change the rate it continues with: a cosine recomputed over a longer run
jumps from min_lr back up, silently. A change that leaves the rate at the saved step as it was (wsd
in its flat phase, a warmup not yet over, a constant rate) moves the end; anything else is refused
on every rank alike (all read the same state), unless optim.rewarm_steps asks for a new decay from
the current rate (schedule.Segment), kept in every later checkpoint. TrainState.horizons keeps each
change, and rank 0 logs it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import yaml

from ..config import OptimConfig
from ..foundation.errors import ConfigError
from ..state import layout
from ..state.checkpoint import Checkpoint
from ..state.manifest_files import read_regular
from ..state.train_state import TrainState
from .schedule import Segment, lr_at, schedule_of

log = logging.getLogger("qgtrain")


class LearningRate:
    def __init__(
        self, optim: OptimConfig, max_steps: int, optimizer: torch.optim.Optimizer
    ) -> None:
        self.optim, self.max_steps, self.optimizer = optim, max_steps, optimizer
        self.schedule = schedule_of(optim)
        # A group built with a rate of its own (Task.optimizer) keeps its ratio to optim.lr.
        self.scales = [
            float(group["lr"]) / optim.lr if optim.lr and "lr" in group else 1.0
            for group in optimizer.param_groups
        ]

    def at(self, state: TrainState) -> float:
        return lr_at(state.step, self.optim, self.max_steps, segment_of(state), self.schedule)

    def set(self, state: TrainState) -> float:
        """Put this step's rate into every parameter group; returns it."""
        lr = self.at(state)
        for group, scale in zip(self.optimizer.param_groups, self.scales, strict=True):
            group["lr"] = lr if scale == 1.0 else lr * scale
        return lr

    def resumed(self, state: TrainState, saved_max_steps: int | None, main: bool) -> None:
        """Check a resumed state against train.max_steps: record a change, or refuse it."""
        old, new, step = saved_max_steps, self.max_steps, state.step
        state.max_steps = new
        if old is None or old == new:
            return
        if new < step:
            raise ConfigError(
                f"train.max_steps: {new} is below step {step}, where the checkpoint "
                f"was saved; give at least {step}"
            )
        before = lr_at(step, self.optim, old, segment_of(state), self.schedule)
        after = lr_at(step, self.optim, new, segment_of(state), self.schedule)
        rewarm = self.optim.rewarm_steps if before != after else None
        if before != after and rewarm is None:
            raise ConfigError(
                f"train.max_steps: changed from {old} to {new} on resume at step {step}, which "
                f"would move the learning rate of optim.schedule: {self.optim.schedule} from "
                f"{before:.3g} to {after:.3g}. HINT: keep train.max_steps: {old}, use "
                "optim.schedule: wsd (extendable in its flat phase), or set optim.rewarm_steps: N "
                "for a new decay from the current learning rate (N steps up to optim.lr first)"
            )
        change: dict[str, Any] = {
            "step": step,
            "from": old,
            "to": new,
            "lr": before,
            "rewarm_steps": rewarm,
        }
        state.horizons.append(change)
        if main:
            how = (
                f"a new decay from lr {before:.3g} ({rewarm} steps up to {self.optim.lr:.3g} "
                f"first) to {self.optim.min_lr:.3g} at step {new}"
                if rewarm is not None
                else f"the learning rate at step {step} stays {before:.3g}; the end moves to {new}"
            )
            log.warning("train.max_steps changed from %d to %d at step %d: %s", old, new, step, how)


def saved_max_steps(ckpt: Checkpoint, state: TrainState) -> int | None:
    """The horizon a checkpoint was trained toward; from its config.yaml if it predates that."""
    if state.max_steps is not None:
        return state.max_steps
    try:
        saved = yaml.safe_load(read_regular(ckpt.path / layout.CONFIG))
        return int(saved["train"]["max_steps"])
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return None


def segment_of(state: TrainState) -> Segment | None:
    """The newest new decay the run's changes of horizon started, if any."""
    for change in reversed(state.horizons):
        if change.get("rewarm_steps") is not None:
            return Segment(int(change["step"]), float(change["lr"]), int(change["rewarm_steps"]))
    return None
