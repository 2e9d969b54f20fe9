"""What a checkpoint of training holds, and putting it back: progress, weights, optimizer, scaler, RNG.

Rank 0 writes the replicated part (model, optimizer and scaler, progress as JSON); every rank writes its
own RNG streams and data position. Under FSDP the model and optimizer are every rank's shards instead
(sharded.py). Restoring on a different world size re-shards the data position where
it divides evenly and re-seeds the random streams, with a warning that the run will not repeat exactly.
"""

from __future__ import annotations

import enum
import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from ..runtime import rng
from ..runtime.rendezvous import DistEnv
from . import sharded
from .checkpoint import Checkpoint, load_file, load_json
from .layout import MODEL, OPTIM, STATE, rank_file
from .sharded import is_sharded_checkpoint, is_sharded_model
from .weights import adapter_of, check_base, load_weights, saved_state, strip_wrapper_prefixes

log = logging.getLogger("qgtrain")


class Outcome(enum.Enum):
    """How a run's training ended; its value is what state.json, manifests and status.json say."""

    FINISHED = "finished"
    EARLY_STOPPED = "stopped early"
    STOPPED_TO_RESUME = "stopped to resume"  # on a signal or before the time limit, at a checkpoint


@dataclass
class TrainState:
    """Everything about progress that a checkpoint must restore. Created before anything reads it."""

    step: int = 0
    epoch: int = 0
    samples_in_epoch: int = 0  # of all ranks together: the data position within `epoch`
    tokens_seen: int = 0
    best_metric: float | None = None  # the best value of early_stopping.metric so far
    evals_since_best: int = 0
    val_metrics: dict[str, float | None] = field(default_factory=dict)  # the latest validation: loss, ...
    test_metrics: dict[str, float | None] = field(default_factory=dict)  # set when the run ends
    outcome: Outcome | None = None  # set by the step that ends the run (finished or stopped early)
    loss_window: list[float] = field(default_factory=list)  # recent losses, oldest first
    spikes_skipped: int = 0  # loss spikes skipped so far, against train.max_skips
    max_steps: int | None = None  # the train.max_steps trained toward (None: an older checkpoint)
    horizons: list[dict[str, Any]] = field(default_factory=list)  # its changes (horizon.py)
    optimizer: str | None = None  # the optimizer's class, as module.Name


def replicated_files(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                     state: TrainState, precision: str, world_size: int) -> dict[str, Any]:
    """The files rank 0 writes: the unwrapped model (no module. or _orig_mod. prefixes), the optimizer and
    loss scaler, and progress with the facts needed to judge a resume."""
    from ..version import __version__

    facts = {"trainer": saved_progress(state), "precision": precision, "world_size": world_size,
             "versions": {"qgtrain": __version__, "torch": torch.__version__},
             "adapter": adapter_of(model)}
    progress = {STATE: json.dumps(facts, indent=1).encode()}
    if is_sharded_model(model):  # the weights and optimizer are every rank's shards (sharded.write)
        return progress
    return {MODEL: saved_state(model),
            OPTIM: {"optimizer": optimizer.state_dict(), "scaler": scaler.state_dict()}, **progress}


def manifest_facts(state: TrainState, evaluated: bool, metric: str, mode: str) -> dict[str, Any]:
    """What a checkpoint's manifest says of it: `qgtrain runs`, rotation and export --best read these."""
    score = state.val_metrics.get(metric.removeprefix("val_")) if evaluated else None
    return {"epoch": state.epoch, "val_loss": state.val_metrics.get("loss") if evaluated else None,
            "tokens_seen": state.tokens_seen,
            "outcome": state.outcome.value if state.outcome else None,
            "score": None if score is None else {"metric": metric, "mode": mode, "value": score}}


def rank_state(state: TrainState, stream: dict[str, Any] | None = None) -> dict[str, Any]:
    """What each rank writes for itself: its random streams (its own GPU's) and where it is in the
    data (for a stream, also its position in its own part: data/streams.py)."""
    own = {"rng": rng.capture(), "epoch": state.epoch, "samples_in_epoch": state.samples_in_epoch}
    return own if stream is None else {**own, "stream": stream}


def stream_position(ckpt: Checkpoint, env: DistEnv) -> dict[str, Any] | None:
    """This rank's saved position in its part of a stream. Each rank's part depends on the world
    size: saved by another, it is every rank's, as {"ranks": [...]}, for a stream that can deal
    them again (data/streams.py refuses one that cannot)."""
    saved = load_json(ckpt, STATE)
    if saved["world_size"] != env.world_size:
        ranks = [load_file(ckpt, rank_file(rank)).get("stream")
                 for rank in range(saved["world_size"])]
        return {"ranks": ranks}
    position = load_file(ckpt, rank_file(env.rank)).get("stream")
    return position if isinstance(position, dict) else None


def restore(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
            env: DistEnv, seed: int, stream: bool = False) -> TrainState:
    """`stream`: the data position is the stream's own (data/streams.py), so a count of samples
    that the new world size does not divide is no obstacle."""
    saved = load_json(ckpt, STATE)
    check_base(saved.get("adapter"), model, ckpt.path)  # before any weight is read
    if is_sharded_checkpoint(ckpt) or is_sharded_model(model):
        sharded.load(ckpt, model, optimizer)
    else:
        load_weights(model, strip_wrapper_prefixes(load_file(ckpt, MODEL)), ckpt.path)
        load_optimizer(ckpt, optimizer, scaler)
    state = _state_from(saved["trainer"])
    if state.samples_in_epoch % env.world_size and not stream:
        raise CheckpointError(
            f"{ckpt.path} was saved by {saved['world_size']} rank(s) after {state.samples_in_epoch} samples of "
            f"epoch {state.epoch}, which {env.world_size} ranks cannot split evenly. HINT: resume with "
            f"{saved['world_size']} ranks, or from a checkpoint at an epoch boundary")
    if saved["world_size"] == env.world_size:
        rng.restore(load_file(ckpt, rank_file(env.rank))["rng"])
    else:
        log.warning("resuming a %d-rank checkpoint on %d ranks: data re-sharded at the saved position, random "
                    "streams re-seeded (the run will not repeat the original exactly)", saved["world_size"],
                    env.world_size)
        rng.seed_everything(rng.rank_seed(seed, env.rank, state.step))
    log.info("resumed from %s: step %d, epoch %d", ckpt.path, state.step, state.epoch)
    return state


def load_optimizer(ckpt: Checkpoint, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
    """Put back the optimizer and loss scaler, or say how the saved state does not fit the model.

    torch checks only the number of parameters per group; a state tensor of the wrong shape would fail
    later, inside the first step, so shapes are checked here against the parameters they belong to.
    """
    path = ckpt.path / OPTIM
    saved = load_file(ckpt, OPTIM)
    try:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        _check_shapes(saved["optimizer"]["state"], params)
        optimizer.load_state_dict(saved["optimizer"])
        scaler.load_state_dict(saved["scaler"])
    except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path} does not fit the configured model and optimizer ({exc}). HINT: resume with "
                              "the model settings it was trained with, or set checkpoint.resume: never") from None


def _check_shapes(state: dict[int, dict[str, Any]], params: list[torch.Tensor]) -> None:
    for index, values in state.items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() and not _fits(value, params[index]):
                raise ValueError(f"state {name!r} of parameter {index} has shape "
                                 f"{tuple(value.shape)}, the parameter "
                                 f"{tuple(params[index].shape)}")


def _fits(state: torch.Tensor, param: torch.Tensor) -> bool:
    """A state tensor shaped as its parameter, or factored along some of its dimensions (Adafactor's
    row and column moments keep those dimensions at 1)."""
    return state.dim() == param.dim() and all(s in (1, p) for s, p in zip(state.shape, param.shape))


def _state_from(saved: dict[str, Any]) -> TrainState:
    """Progress as saved, including by qgtrain 0.1.0 before tasks (val_loss fields, not metrics)."""
    saved = dict(saved)
    if "best_val_loss" in saved:
        saved["best_metric"] = saved.pop("best_val_loss")
        saved["val_metrics"] = {"loss": saved.pop("val_loss", None)}
        saved["test_metrics"] = {"loss": test} if (test := saved.pop("test_loss", None)) is not None else {}
    if (outcome := saved.get("outcome")) is not None:
        known = {o.value: o for o in Outcome}
        if outcome not in known:
            raise CheckpointError(f"state.json: the outcome {str(outcome)[:40]!r} is none of "
                                  f"{', '.join(known)}")
        saved["outcome"] = known[outcome]
    return TrainState(**saved)


def saved_progress(state: TrainState) -> dict[str, Any]:
    """The state as state.json holds it: plain JSON, the outcome by its value."""
    return {**asdict(state), "outcome": state.outcome.value if state.outcome else None}
