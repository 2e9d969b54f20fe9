"""Global-norm gradient clipping and the update, with its skip of non-finite steps: a step's use of
the optimizer (optimizers.py builds it, from config/optim.py's section)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from ..config import OptimConfig
from .optimizers import builtin


def adamw(model: nn.Module, optim: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """optim.name: adamw whatever the config names (benchmarks and tests build it directly)."""
    return builtin("adamw")(model, dataclasses.replace(optim, name="adamw", args={}), device)


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
    shards reduces it over them (parallel/strategy.py), so every rank clips by the factor an
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
