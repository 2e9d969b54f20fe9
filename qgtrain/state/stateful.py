"""The named parts of a checkpoint that the state package owns: weights, optimizer, loss scaler, the
random streams and the facts that judge a resume, each with DCP's Stateful protocol.

A part is anything with `state_dict()` and `load_state_dict(state)`, as
torch.distributed.checkpoint.stateful.Stateful asks: the trainer registers each under its name
(training/saved_parts.py), named.py puts each state where layout.PLACES says and gives it back on
resume. A part never sees a file or a path: its messages name the checkpoint being loaded through
`source()`, set while named.py loads. A part given an empty state was not saved in the checkpoint
(an older one, or a run without it) and says what it does instead.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ..foundation.errors import CheckpointError
from ..runtime import rng
from ..runtime.rendezvous import DistEnv
from .checkpoint import Checkpoint, load_file
from .layout import OPTIM, PLACES, rank_file
from .sharded import shard_options
from .weights import adapter_of, check_base, load_weights, saved_state, strip_wrapper_prefixes

log = logging.getLogger("qgtrain")
_SOURCE: contextvars.ContextVar[Checkpoint] = contextvars.ContextVar("qgtrain_checkpoint")


@runtime_checkable
class Stateful(Protocol):
    """torch.distributed.checkpoint.stateful.Stateful, as a type of our own: importing that
    module imports DCP, which most starts never need."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@contextlib.contextmanager
def loading(ckpt: Checkpoint) -> Iterator[None]:
    token = _SOURCE.set(ckpt)
    try:
        yield
    finally:
        _SOURCE.reset(token)


def source() -> Path:
    """The folder of the checkpoint being loaded, for a part's messages."""
    return _SOURCE.get().path


def source_step() -> int:
    return _SOURCE.get().step


def every_rank(name: str, world_size: int) -> list[Any]:
    """The per-rank part `name` as each of the `world_size` ranks that saved the checkpoint being
    loaded wrote it: for a part whose ranks' states a new world size can deal again (a stream of
    data files), which needs them all where each rank would otherwise read its own."""
    ckpt, key = _SOURCE.get(), PLACES[name].key
    return [load_file(ckpt, rank_file(rank)).get(key) for rank in range(world_size)]


class ModelState:
    """ "model": the unwrapped model's weights (an adapted model's trainable ones only: its base
    comes from where it was built); a sharded model's are ShardedModelState's."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return saved_state(self.model)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        load_weights(self.model, strip_wrapper_prefixes(state_dict), source())


class OptimizerState:
    """ "optimizer": its state by parameter index (torch's own); a sharded model's by name
    (ShardedOptimizerState)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch checks only the number of parameters per group; a state tensor of the wrong shape
        would fail later, inside the first step, so shapes are checked here first."""
        try:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            _check_shapes(state_dict["state"], params)
            self.optimizer.load_state_dict(state_dict)
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as exc:
            raise _does_not_fit(exc) from None


class ShardedModelState(ModelState):
    """ "model" of a sharded model (training/parallel/strategy.py chooses it): this rank's
    shards."""

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model, options=shard_options(self.model))


class ShardedOptimizerState(OptimizerState):
    """ "optimizer" of a sharded model: its state by parameter name, this rank's shards."""

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(
            self.model, self.optimizer, options=shard_options(self.model)
        )


class ScalerState:
    """ "scaler": fp16's loss scale (empty for other precisions)."""

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        self.scaler = scaler

    def state_dict(self) -> dict[str, Any]:
        return self.scaler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        try:
            self.scaler.load_state_dict(state_dict)
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise _does_not_fit(exc) from None


def _does_not_fit(exc: BaseException) -> CheckpointError:
    return CheckpointError(
        f"{source() / OPTIM} does not fit the configured model and optimizer "
        f"({exc}). HINT: resume with the model settings it was trained with, or "
        "set checkpoint.resume: never"
    )


class RunFacts:
    """ "facts": what the checkpoint was saved with, read first on resume: the base of an adapted
    model (checked before any weight is read) and the world size (the random streams and the data
    position of each rank belong to it)."""

    def __init__(self, model: nn.Module, precision: str, env: DistEnv) -> None:
        self.model, self.precision, self.env = model, precision, env
        self.saved_world_size = env.world_size

    def state_dict(self) -> dict[str, Any]:
        from ..foundation.version import __version__

        return {
            "precision": self.precision,
            "world_size": self.env.world_size,
            "versions": {"qgtrain": __version__, "torch": torch.__version__},
            "adapter": adapter_of(self.model),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        check_base(state_dict.get("adapter"), self.model, source())
        self.saved_world_size = int(state_dict["world_size"])


class RngState:
    """ "rng": this rank's random streams. Resumed on another world size, the saved streams belong
    to ranks that no longer exist: each rank is re-seeded from the seed, its rank and the step."""

    def __init__(self, facts: RunFacts, env: DistEnv, seed: int, step: Any) -> None:
        self.facts, self.env, self.seed, self.step = facts, env, seed, step

    def state_dict(self) -> dict[str, Any]:
        return rng.capture()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = self.facts.saved_world_size
        if saved == self.env.world_size:
            rng.restore(state_dict)
            return
        log.warning(
            "resuming a %d-rank checkpoint on %d ranks: data re-sharded at the saved "
            "position, random streams re-seeded (the run will not repeat the original "
            "exactly)",
            saved,
            self.env.world_size,
        )
        rng.seed_everything(rng.rank_seed(self.seed, self.env.rank, self.step()))


def _check_shapes(state: dict[int, dict[str, Any]], params: list[torch.Tensor]) -> None:
    for index, values in state.items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() and not _fits(value, params[index]):
                raise ValueError(
                    f"state {name!r} of parameter {index} has shape "
                    f"{tuple(value.shape)}, the parameter "
                    f"{tuple(params[index].shape)}"
                )


def _fits(state: torch.Tensor, param: torch.Tensor) -> bool:
    """A state tensor shaped as its parameter, or factored along some of its dimensions (Adafactor's
    row and column moments keep those dimensions at 1)."""
    return state.dim() == param.dim() and all(s in (1, p) for s, p in zip(state.shape, param.shape))
