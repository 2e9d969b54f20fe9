"""The early_stopping section: which validation metric, how patient, decided on rank 0."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .eval import task_metrics
from .fields import Problem, setting

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass(frozen=True)
class EarlyStoppingConfig:
    patience: int = setting(0, "validations without improvement before stopping (0 = off)", min=0)
    min_delta: float = setting(0.0, "improvement in the metric that counts", min=0.0)
    metric: str = setting(
        "val_loss",
        "what early stopping and the best checkpoint follow: val_loss, val_<name> for a "
        "metric the task reports, or eval_<task>_<metric> of an eval.tasks entry",
    )
    mode: Literal["min", "max"] = setting(
        "min", "min: lower is better (losses); max: higher is better (accuracy)"
    )


def early_stopping_rules(cfg: RunConfig) -> Problem:
    metric = cfg.early_stopping.metric
    if metric.startswith("eval_") and metric not in (known := task_metrics(cfg)):
        return "early_stopping.metric", (
            f"'{metric}' is not reported by eval.tasks (they report "
            f"{', '.join(known) or 'nothing: eval.tasks is empty'})"
        )
    if not metric.startswith(("val_", "eval_")):
        return "early_stopping.metric", (
            f"'{metric}' is not a validation metric; use val_loss, val_<name> for a metric "
            "your task reports, or eval_<task>_<metric> of an eval.tasks entry"
        )
    if cfg.early_stopping.patience and not cfg.train.eval_every:
        return "early_stopping.patience", (
            "early stopping needs validations: set train.eval_every > 0"
        )
    return None
