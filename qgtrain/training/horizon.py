"""The learning rate of each step, and the guard on a changed train.max_steps when a run resumes.

A checkpoint records the horizon it was trained toward (its "horizon" part: this class's state).
A resume toward another one must not change the rate it continues with: a cosine recomputed over a
longer run jumps from min_lr back up, silently. A change that leaves the rate at the saved step as
it was (wsd in its flat phase, a warmup not yet over, a constant rate) moves the end; anything else
is refused on every rank alike (all read the same state), unless optim.rewarm_steps asks for a new
decay from the current rate (schedule.Segment), kept in every later checkpoint. `horizons` keeps
each change, and rank 0 logs it. A checkpoint older than the record is read with its config.yaml's
train.max_steps (state/named.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..config import OptimConfig
from ..foundation.errors import ConfigError
from ..state.train_state import TrainState
from .schedule import Segment, lr_at, schedule_of

log = logging.getLogger("qgtrain")


class LearningRate:
    """The rate of each step, and the checkpoint's "horizon": the train.max_steps trained toward
    and its changes, each a new decay or a moved end (`horizons`)."""

    def __init__(
        self,
        optim: OptimConfig,
        max_steps: int,
        optimizer: torch.optim.Optimizer,
        state: TrainState,
        main: bool = True,
    ) -> None:
        self.optim, self.max_steps, self.optimizer = optim, max_steps, optimizer
        self.state, self.main = state, main  # the run's progress: the step a resume is at
        self.schedule = schedule_of(optim)
        self.horizons: list[dict[str, Any]] = []
        # A group built with a rate of its own (Task.optimizer) keeps its ratio to optim.lr.
        self.scales = [
            float(group["lr"]) / optim.lr if optim.lr and "lr" in group else 1.0
            for group in optimizer.param_groups
        ]

    def at(self, state: TrainState) -> float:
        return lr_at(
            state.step, self.optim, self.max_steps, segment_of(self.horizons), self.schedule
        )

    def set(self, state: TrainState) -> float:
        """Put this step's rate into every parameter group; returns it."""
        lr = self.at(state)
        for group, scale in zip(self.optimizer.param_groups, self.scales, strict=True):
            group["lr"] = lr if scale == 1.0 else lr * scale
        return lr

    def state_dict(self) -> dict[str, Any]:
        return {"max_steps": self.max_steps, "horizons": [dict(h) for h in self.horizons]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check a resumed horizon against train.max_steps: record a change, or refuse it (a
        horizon of None: a checkpoint that records none, taken as it is)."""
        self.horizons = [dict(h) for h in state_dict.get("horizons") or []]
        old, new, step = state_dict.get("max_steps"), self.max_steps, self.state.step
        if old is None or old == new:
            return
        if new < step:
            raise ConfigError(
                f"train.max_steps: {new} is below step {step}, where the checkpoint "
                f"was saved; give at least {step}"
            )
        segment = segment_of(self.horizons)
        before = lr_at(step, self.optim, old, segment, self.schedule)
        after = lr_at(step, self.optim, new, segment, self.schedule)
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
        self.horizons.append(change)
        if self.main:
            how = (
                f"a new decay from lr {before:.3g} ({rewarm} steps up to {self.optim.lr:.3g} "
                f"first) to {self.optim.min_lr:.3g} at step {new}"
                if rewarm is not None
                else f"the learning rate at step {step} stays {before:.3g}; the end moves to {new}"
            )
            log.warning("train.max_steps changed from %d to %d at step %d: %s", old, new, step, how)


def segment_of(horizons: list[dict[str, Any]]) -> Segment | None:
    """The newest new decay the run's changes of horizon started, if any."""
    for change in reversed(horizons):
        if change.get("rewarm_steps") is not None:
            return Segment(int(change["step"]), float(change["lr"]), int(change["rewarm_steps"]))
    return None
