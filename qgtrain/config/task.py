"""The task section: which function builds the run's qgtrain.Task, and its free-form options."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..foundation.task import BUILTIN_LM
from .fields import Problem, factory_problem, setting

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass(frozen=True)
class TaskConfig:
    factory: str = setting(
        BUILTIN_LM,
        "'package.module:function' called with the resolved config on every rank, "
        "returning a qgtrain.Task (default: the built-in causal LM, set up by model and data)",
    )
    options: dict[str, Any] = setting(
        {},
        "free-form settings for your task function, read as cfg.task.options (--set "
        "task.options.NAME=VALUE)",
    )


def task_rules(cfg: RunConfig) -> Problem:
    return factory_problem("task.factory", cfg.task.factory)
