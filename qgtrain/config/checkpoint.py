"""The checkpoint section: how often, how many kept, written in the background or not, and
resumed how."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .fields import Problem, setting

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = setting(200, "steps between checkpoints (0 = off)", min=0)
    every_minutes: float = setting(
        0.0, "minutes between checkpoints, agreed by all ranks (0 = off)", min=0.0
    )
    keep_last: int = setting(3, "checkpoints kept besides the best one (at least 2)")
    resume: str = setting(
        "auto", "auto: the latest valid checkpoint of the run; never; or a checkpoint path"
    )
    async_save: bool = setting(
        False, "copy state to memory at the step and write it in the background"
    )


def checkpoint_rules(cfg: RunConfig) -> Problem:
    if cfg.checkpoint.keep_last < 2:
        return "checkpoint.keep_last", (
            f"{cfg.checkpoint.keep_last} is below 2: the newest checkpoint may be half-written "
            "when a job dies, so the one before it must survive rotation"
        )
    return None
