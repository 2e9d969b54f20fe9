"""The early_stopping section: which validation metric, how patient, decided on rank 0."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .fields import Problem, setting

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass(frozen=True)
class EarlyStoppingConfig:
    patience: int = setting(0, "validations without improvement before stopping (0 = off)", min=0)
    min_delta: float = setting(0.0, "improvement in the metric that counts", min=0.0)
    metric: str = setting(
        "val_loss",
        "what early stopping and the best checkpoint follow: val_loss or val_<name> "
        "for a metric the task reports",
    )
    mode: Literal["min", "max"] = setting(
        "min", "min: lower is better (losses); max: higher is better (accuracy)"
    )


def early_stopping_rules(cfg: RunConfig) -> Problem:
    if not cfg.early_stopping.metric.startswith("val_"):
        return "early_stopping.metric", (
            f"'{cfg.early_stopping.metric}' is not a validation metric; use val_loss "
            "or val_<name> for a metric your task reports"
        )
    if cfg.early_stopping.patience and not cfg.train.eval_every:
        return "early_stopping.patience", (
            "early stopping needs validations: set train.eval_every > 0"
        )
    return None
