"""The learning rate as a pure function of the step: a warmup, then the configured shape.

Because it depends on the step alone, restoring the step restores the schedule exactly; there is
no scheduler object whose state could drift from the checkpoint. `step` counts the optimizer steps
taken before the one the rate is for; every built-in schedule warms up linearly over
optim.warmup_steps. A change of train.max_steps on resume may add a `Segment` (horizon.py), a pure
function of the step too, saved in the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

from ..config import OptimConfig
from ..foundation.errors import ConfigError
from ..foundation.factory import load_factory

Schedule = Callable[[int, int, OptimConfig], float]  # (step, max_steps, optim) -> learning rate


def _warmup(step: int, optim: OptimConfig) -> float | None:
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    return None


def _between(top: float, optim: OptimConfig, shape: str, progress: float) -> float:
    """From `top` (progress 0) to min_lr (progress 1) along `shape`."""
    progress = min(max(progress, 0.0), 1.0)
    left = {
        "linear": 1.0 - progress,
        "cosine": 0.5 * (1.0 + math.cos(math.pi * progress)),
        "sqrt": 1.0 - math.sqrt(progress),
    }[shape]
    return optim.min_lr + left * (top - optim.min_lr)


def cosine(step: int, max_steps: int, optim: OptimConfig) -> float:
    """Today's default, value for value."""
    if (warm := _warmup(step, optim)) is not None:
        return warm
    decay_steps = max(max_steps - optim.warmup_steps, 1)
    progress = min(max(step - optim.warmup_steps, 0) / decay_steps, 1.0)
    return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)


def linear(step: int, max_steps: int, optim: OptimConfig) -> float:
    if (warm := _warmup(step, optim)) is not None:
        return warm
    decay_steps = max(max_steps - optim.warmup_steps, 1)
    return _between(optim.lr, optim, "linear", (step - optim.warmup_steps) / decay_steps)


def constant(step: int, max_steps: int, optim: OptimConfig) -> float:
    warm = _warmup(step, optim)
    return optim.lr if warm is None else warm


def decay_start(max_steps: int, optim: OptimConfig) -> int:
    """wsd's first decaying step: the last optim.decay_fraction of the run, after the warmup."""
    return max(max_steps - max(round(optim.decay_fraction * max_steps), 1), optim.warmup_steps)


def wsd(step: int, max_steps: int, optim: OptimConfig) -> float:
    """Warmup, stable (flat at optim.lr), decay: a run extends from anywhere in its flat phase."""
    if (warm := _warmup(step, optim)) is not None:
        return warm
    start = decay_start(max_steps, optim)
    if step < start:
        return optim.lr
    return _between(optim.lr, optim, optim.decay_shape, (step - start) / max(max_steps - start, 1))


def inverse_sqrt(step: int, max_steps: int, optim: OptimConfig) -> float:
    """lr * sqrt(warmup / steps) after the warmup, never below min_lr; independent of max_steps."""
    if (warm := _warmup(step, optim)) is not None:
        return warm
    return max(optim.min_lr, optim.lr * math.sqrt(max(optim.warmup_steps, 1) / (step + 1)))


SCHEDULES: dict[str, Schedule] = {
    "cosine": cosine,
    "linear": linear,
    "constant": constant,
    "wsd": wsd,
    "inverse_sqrt": inverse_sqrt,
}


def schedule_of(optim: OptimConfig) -> Schedule:
    """The built-in schedule optim.schedule names, or the user's function (imported on a rank)."""
    if optim.schedule in SCHEDULES:
        return SCHEDULES[optim.schedule]
    function = load_factory(optim.schedule, "optim.schedule")
    if not callable(function):
        raise ConfigError(
            f"optim.schedule: {optim.schedule!r} is a {type(function).__name__}, "
            "not a function of (step, max_steps, optim)"
        )
    return function


class Segment(NamedTuple):
    """A new decay from `start` (a resume whose max_steps changed): from `start_lr`, `rewarm` steps
    up to optim.lr when `rewarm` > 0, then down to min_lr at max_steps. wsd keeps its flat phase
    before its decay, cosine decays along a cosine, anything else along optim.decay_shape."""

    start: int
    start_lr: float
    rewarm: int


def segment_lr(step: int, max_steps: int, optim: OptimConfig, segment: Segment) -> float:
    into = step - segment.start
    if into < segment.rewarm:
        return segment.start_lr + (optim.lr - segment.start_lr) * into / segment.rewarm
    top = optim.lr if segment.rewarm else segment.start_lr
    begin = segment.start + segment.rewarm
    if optim.schedule == "wsd":
        begin = max(begin, decay_start(max_steps, optim))
    shape = "cosine" if optim.schedule == "cosine" else optim.decay_shape
    return _between(top, optim, shape, (step - begin) / max(max_steps - begin, 1))


def lr_at(
    step: int,
    optim: OptimConfig,
    max_steps: int,
    segment: Segment | None = None,
    schedule: Schedule | None = None,
) -> float:
    if segment is not None and step >= segment.start:
        return segment_lr(step, max_steps, optim, segment)
    return float((schedule or schedule_of(optim))(step, max_steps, optim))
