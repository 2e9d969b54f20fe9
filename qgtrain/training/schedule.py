"""The learning rate as a pure function of the step: linear warmup, then cosine decay to min_lr.

Because it depends on the step alone, restoring the step restores the schedule exactly; there is no
scheduler object whose state could drift from the checkpoint.
"""

from __future__ import annotations

import math

from ..config import OptimConfig


def lr_at(step: int, optim: OptimConfig, max_steps: int) -> float:
    if optim.warmup_steps and step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    decay_steps = max(max_steps - optim.warmup_steps, 1)
    progress = min(max(step - optim.warmup_steps, 0) / decay_steps, 1.0)
    return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)
