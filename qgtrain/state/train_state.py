"""The run's progress, the part of a checkpoint that says where training stands: the step, the data
position of all ranks together, the metrics and how the run ended (state.json's `trainer`), and
what its manifest says of it. Its other parts are their owners' (stateful.py, named.py).
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from ..foundation.errors import CheckpointError


class Outcome(enum.Enum):
    """How a run's training ended; its value is what state.json, manifests and status.json say."""

    FINISHED = "finished"
    EARLY_STOPPED = "stopped early"
    STOPPED_TO_RESUME = "stopped to resume"  # on a signal or before the time limit, at a checkpoint


@dataclass
class TrainState:
    """Everything about progress that a checkpoint must restore. Created before anything reads
    it."""

    step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0  # of all ranks together: the data position within `epoch`
    tokens_seen: int = 0
    best_metric: float | None = None  # the best value of early_stopping.metric so far
    evals_since_best: int = 0
    # the latest validation: loss, ...
    val_metrics: dict[str, float | None] = field(default_factory=dict)
    test_metrics: dict[str, float | None] = field(default_factory=dict)  # set when the run ends
    # the latest downstream tasks' figures, by their full names: eval_<task>_<metric>
    eval_metrics: dict[str, float | None] = field(default_factory=dict)
    outcome: Outcome | None = None  # set by the step that ends the run (finished or stopped early)
    optimizer: str | None = None  # the optimizer's class, as module.Name


def manifest_facts(state: TrainState, evaluated: bool, metric: str, mode: str) -> dict[str, Any]:
    """What a checkpoint's manifest says of it: `qgtrain runs`, rotation and export --best read
    these."""
    score = metric_value(state, metric) if evaluated else None
    return {
        "epoch": state.epoch,
        "val_loss": state.val_metrics.get("loss") if evaluated else None,
        "tokens_seen": state.tokens_seen,
        "outcome": state.outcome.value if state.outcome else None,
        "score": None if score is None else {"metric": metric, "mode": mode, "value": score},
        # every figure of the validation, for `export --best METRIC`
        "metrics": {
            **{f"val_{name}": value for name, value in state.val_metrics.items()},
            **state.eval_metrics,
        }
        if evaluated
        else None,
    }


def metric_value(state: TrainState, metric: str) -> float | None:
    """The latest value of early_stopping.metric: val_<name> or a downstream eval_<task>_<m>."""
    if metric.startswith("eval_"):
        return state.eval_metrics.get(metric)
    return state.val_metrics.get(metric.removeprefix("val_"))


class ProgressState:
    """ "train_state": the run's progress (state.json's `trainer`, beside the spike window's and the
    horizon's entries), put back into the same TrainState object, which the loop goes on with."""

    def __init__(self, state: TrainState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return saved_progress(self.state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = _state_from(state_dict)
        for name in (f.name for f in fields(TrainState)):
            setattr(self.state, name, getattr(saved, name))


def _state_from(saved: dict[str, Any]) -> TrainState:
    """Progress as saved, including by qgtrain 0.1.0 before tasks (val_loss fields, not metrics).
    The other parts' entries beside it (the spike window, the horizon) are theirs."""
    own = {f.name for f in fields(TrainState)} | {"best_val_loss", "val_loss", "test_loss"}
    saved = {key: value for key, value in saved.items() if key in own}
    if "best_val_loss" in saved:
        saved["best_metric"] = saved.pop("best_val_loss")
        saved["val_metrics"] = {"loss": saved.pop("val_loss", None)}
        saved["test_metrics"] = (
            {"loss": test} if (test := saved.pop("test_loss", None)) is not None else {}
        )
    if (outcome := saved.get("outcome")) is not None:
        known = {o.value: o for o in Outcome}
        if outcome not in known:
            raise CheckpointError(
                f"state.json: the outcome {str(outcome)[:40]!r} is none of {', '.join(known)}"
            )
        saved["outcome"] = known[outcome]
    return TrainState(**saved)


def saved_progress(state: TrainState) -> dict[str, Any]:
    """The state as state.json holds it: plain JSON, the outcome by its value."""
    return {**asdict(state), "outcome": state.outcome.value if state.outcome else None}
