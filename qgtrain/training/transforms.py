"""Model transforms: what changes the task's model between building it and wrapping it for parallel
training, in the order of TRANSFORMS, each applied where its setting asks for it.

A transform takes the task's model and returns the model to train (the same object changed in place,
as all of these do, so the names in checkpoints stay the model's own). They run on every rank with
the same seed, before the ranks' random streams part, so anything a transform draws (LoRA's initial
adapters) is the same everywhere. torch.compile is not among them: it must follow them (it traces
what they made) and precede sharding, so the wrap applies it (parallel/strategy.py). A new
transform is a function here, a row in the table and the setting that turns it on.

Activation checkpointing replaces a block's `forward` on the instance with a non-reentrant
checkpoint of the original, instead of wrapping the block in another module: parameter names (and so
checkpoints and export) stay what they are without it, and it works the same under DDP and FSDP.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import RunConfig
from ..foundation.errors import ConfigError
from .adapters import apply_adapter
from .parallel import sharding
from .parallel.strategy import Strategy

log = logging.getLogger("qgtrain")

Transform = Callable[[nn.Module, RunConfig, Strategy], nn.Module]


def _adapter(model: nn.Module, cfg: RunConfig, strategy: Strategy) -> nn.Module:
    return apply_adapter(model, cfg)


def _sync_batchnorm(model: nn.Module, cfg: RunConfig, strategy: Strategy) -> nn.Module:
    problem = strategy.sync_batchnorm_problem()
    if problem:
        raise ConfigError(problem)
    if strategy.env.world_size > 1:
        to_sync_batchnorm(model, strategy.env.world_size)
    return model


def _activation_checkpointing(model: nn.Module, cfg: RunConfig, strategy: Strategy) -> nn.Module:
    checkpoint_activations(sharding.find_blocks(model, cfg.train.shard_modules))
    return model


# name -> (whether the config asks for it, the transform), in the order they are applied
TRANSFORMS: dict[str, tuple[Callable[[RunConfig], bool], Transform]] = {
    "adapter": (lambda cfg: cfg.model.adapter != "none", _adapter),
    "sync_batchnorm": (lambda cfg: cfg.train.sync_batchnorm, _sync_batchnorm),
    "activation_checkpointing": (
        lambda cfg: cfg.train.activation_checkpointing,
        _activation_checkpointing,
    ),
}


def transformed(model: nn.Module, cfg: RunConfig, strategy: Strategy) -> nn.Module:
    """The task's model with every transform the config asks for applied, in TRANSFORMS' order."""
    applied = []
    for name, (asked, transform) in TRANSFORMS.items():
        if asked(cfg):
            model = transform(model, cfg, strategy)
            applied.append(name)
    if applied:
        log.info("model transforms: %s", ", ".join(applied))
    return model


def to_sync_batchnorm(model: nn.Module, world_size: int) -> int:
    """Replace the model's batch norm layers by SyncBatchNorm in place, keeping their parameters and
    buffers (the same tensors, so names and checkpoints do not change). Returns how many."""
    for name, child in model.named_children():
        model.add_module(name, nn.SyncBatchNorm.convert_sync_batchnorm(child))
    converted = sum(isinstance(m, nn.SyncBatchNorm) for m in model.modules())
    if converted:
        log.info(
            "sync_batchnorm: %d batch norm layer(s) normalize by the statistics of all %d ranks' "
            "batches",
            converted,
            world_size,
        )
    else:
        log.warning(
            "train.sync_batchnorm is set, but %s has no batch norm layer: nothing to synchronize",
            type(model).__name__,
        )
    return converted


def checkpoint_activations(blocks: Sequence[nn.Module]) -> None:
    for block in blocks:
        block.forward = functools.partial(_recomputed, block.forward)


def _recomputed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
