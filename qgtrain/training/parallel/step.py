"""A step on the model as its strategy set it up (Strategy.setup): the task's loss over the
micro-batches, scaled, backward and reduced as the strategy allows without holding more memory than
one micro-batch needs; the global-norm clip; the update, with its skip of non-finite steps.

ParallelModel keeps what the strategy wrapped beside the optimizer and the loss scaler, so the
loop asks one object for a step's backward, clip and update, and for the replicas' agreement
before a checkpoint or an evaluation, as Lightning Fabric's strategies do. The functions under it
are the arithmetic, also called by benchmarks and tests on a model they wrapped themselves.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...foundation.errors import TaskError
from ...runtime.precision import autocast, weights_cast_once

if TYPE_CHECKING:
    from .strategy import Strategy


@dataclass
class ParallelModel:
    """`model` is the user's module (evaluated, clipped, checkpointed), `wrapped` what forward and
    backward go through (DDP, torch.compile; under fsdp the model itself, sharded in place),
    `precision` the resolved one: fp32, bf16 or fp16."""

    strategy: Strategy
    model: nn.Module
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    precision: str

    def backward(self, loss_fn: Any, micro_batches: list[Any]) -> torch.Tensor:
        """The step's gradients; returns its mean loss on the device, without synchronizing."""
        return accumulate_gradients(
            self.wrapped,
            loss_fn,
            micro_batches,
            self.precision,
            self.scaler,
            self.strategy.device,
            strategy=self.strategy,
        )

    def clip(self, max_norm: float) -> torch.Tensor:
        """Unscale (fp16) and clip to the model's global norm (0 = never); returns the norm before
        clipping, on the device."""
        self.scaler.unscale_(self.optimizer)
        return clip_gradients(
            self.model, max_norm, self.strategy.device, whole=self.strategy.whole_norm
        )

    def update(self, skip: torch.Tensor) -> torch.Tensor:
        """The optimizer step unless `skip` (apply_update), then the gradients dropped; returns the
        device flag of an update not taken."""
        skipped = apply_update(self.optimizer, self.scaler, skip)
        self.optimizer.zero_grad(set_to_none=True)
        return skipped

    def unused_parameters(self, looked_for: bool) -> list[str]:
        """The trained parameters the backward just run left without a gradient, where the strategy
        would wait for them forever (DDP, unless `looked_for`: train.find_unused_parameters)."""
        if not self.strategy.needs_every_gradient or looked_for:
            return []
        return without_gradients(self.model)

    def agree_before_save(self, step: int) -> None:
        self.strategy.agree_before_save(self.model, self.wrapped, step)

    def agree_before_evaluation(self) -> None:
        self.strategy.agree_before_evaluation(self.model, self.wrapped)


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


def clip_gradients(
    model: nn.Module,
    max_norm: float,
    device: torch.device,
    whole: Callable[[torch.Tensor], torch.Tensor] = lambda norm: norm,
) -> torch.Tensor:
    """Clip to max_norm (0 = never) and return the norm before clipping, as a tensor on `device` (no
    host sync). At 0 the gradients are left alone: clipping to infinity would still multiply every
    one by 1.0.

    `whole` turns the norm of this rank's gradients into the model's: a strategy whose ranks hold
    shards reduces it over them (Strategy.whole_norm), so every rank clips by the factor an
    unsharded run would. A model without gradients has norm 0 on the rank's device, where the
    report stacks it with the loss (torch's get_total_norm of no tensors is a CPU tensor).
    """
    params = [p for p in model.parameters() if p.grad is not None]
    if not params:
        return torch.zeros((), device=device)
    norm = whole(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


def apply_update(
    optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, skip: torch.Tensor
) -> torch.Tensor:
    """Take the optimizer step unless `skip`, a device flag the same on every rank (the reduced
    gradients were non-finite), without reading it on the host where the optimizer can skip on the
    device.

    Fused Adam, AdamW and SGD (`_step_supports_amp_scaling`) take a `found_inf` tensor as GradScaler
    gives it: a non-zero value skips the update in the kernel and takes back the step count
    (torch/optim/adam.py _fused_adam, torch/amp/grad_scaler.py GradScaler.step). Any other
    optimizer reads the flag (a host sync, free on a CPU). fp16 leaves non-finite steps to its
    GradScaler.

    Returns the device flag of an update not taken: `skip`, or under fp16 what the scaler found
    (read before its update forgets it), for what must follow applied updates only (ema.py).
    """
    skipped = skip
    if scaler.is_enabled():
        scaler.step(optimizer)
        found = scaler._found_inf_per_device(optimizer).values()
        skipped = torch.stack([f.to(skip.device) for f in found]).sum() > 0
    elif getattr(optimizer, "_step_supports_amp_scaling", False):
        setattr(optimizer, "found_inf", skip.float())
        try:
            optimizer.step()
        finally:
            delattr(optimizer, "found_inf")
    elif not bool(skip):
        optimizer.step()
    scaler.update()
    return skipped
