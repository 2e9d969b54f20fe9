"""One step's gradients: the task's loss over the micro-batches, scaled, backward, reduced once under DDP."""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import ConfigError
from ..runtime import precision
from ..state.sharded import is_sharded_model


def accumulate_gradients(model: nn.Module, loss_fn: Any, micro_batches: list[Any], precision_name: str,
                         scaler: torch.amp.GradScaler, device: torch.device) -> torch.Tensor:
    """Backward over the micro-batches of one step; the gradient equals one batch k times larger.

    Under DDP gradients are all-reduced on the last micro-step only (no_sync before it); under FSDP they
    are reduce-scattered on the last only. Returns the step's mean loss as a device tensor, without
    synchronizing.
    """
    loss_sum: torch.Tensor | None = None
    sharded = is_sharded_model(model)
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        if sharded and len(micro_batches) > 1:
            cast(Any, model).set_requires_gradient_sync(last)  # FSDPModule's
        with model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext():
            with precision.autocast(precision_name, device):
                loss = checked_loss(loss_fn(model, batch)) / len(micro_batches)
            scaler.scale(loss).backward()
        loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
    assert loss_sum is not None
    return loss_sum


def without_gradients(model: nn.Module) -> list[str]:
    """The trainable parameters that received no gradient in the backward just run."""
    return [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]


def checked_loss(loss: Any) -> torch.Tensor:
    """The task's loss, if it is one: a floating-point scalar tensor that backward can start from."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        shown = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ConfigError(f"task: loss(model, batch) returned {shown}; it must return a floating-point scalar "
                          "tensor (reduce it, e.g. with .mean())")
    return loss
