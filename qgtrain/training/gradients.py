"""One step's gradients: the task's loss over the micro-batches, scaled, backward, reduced as each
parallel layout allows without holding more memory than one micro-batch needs."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..foundation.errors import TaskError
from ..runtime.precision import autocast, weights_cast_once
from .parallel.strategy import Strategy


def accumulate_gradients(
    model: nn.Module,
    loss_fn: Any,
    micro_batches: list[Any],
    precision_name: str,
    scaler: torch.amp.GradScaler,
    device: torch.device,
    *,
    strategy: Strategy,
) -> torch.Tensor:
    """Backward over the micro-batches of one step; the gradient equals one batch k times larger.
    `model` is what `strategy` wrapped: what each micro-batch but the last may postpone, and the
    precision autocast computes in, are the strategy's.

    Returns the step's mean loss as a device tensor, without synchronizing.
    """
    loss_sum: torch.Tensor | None = None
    precision = strategy.autocast_precision(precision_name)
    with weights_cast_once(precision, device):
        for index, batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            with strategy.reduction_deferred(model, not last):
                with autocast(precision, device):
                    loss = checked_loss(loss_fn(model, batch)) / len(micro_batches)
                scaler.scale(loss).backward()
            loss = loss.detach().float()
            loss_sum = loss if loss_sum is None else loss_sum + loss
    assert loss_sum is not None
    return loss_sum


def without_gradients(model: nn.Module) -> list[str]:
    """The trainable parameters that received no gradient in the backward just run."""
    return [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]


def checked_loss(loss: Any) -> torch.Tensor:
    """The task's loss, if it is one: a floating-point scalar tensor that backward can start
    from."""
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        shown = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else type(loss).__name__
        )
        raise TaskError(
            f"task: loss(model, batch) returned {shown}; it must return a "
            "floating-point scalar tensor (reduce it, e.g. with .mean())"
        )
    return loss
