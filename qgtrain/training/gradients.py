"""One step's gradients: the task's loss over the micro-batches, scaled, backward, reduced as each
parallel layout allows without holding more memory than one micro-batch needs."""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..foundation.errors import TaskError
from ..state.sharded import is_sharded_model, shard_of
from .sharding import autocast_for


def accumulate_gradients(
    model: nn.Module,
    loss_fn: Any,
    micro_batches: list[Any],
    precision_name: str,
    scaler: torch.amp.GradScaler,
    device: torch.device,
) -> torch.Tensor:
    """Backward over the micro-batches of one step; the gradient equals one batch k times larger.

    Returns the step's mean loss as a device tensor, without synchronizing.
    """
    loss_sum: torch.Tensor | None = None
    for index, batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with _reduction_deferred(model, not last):
            with autocast_for(model, precision_name, device):
                loss = checked_loss(loss_fn(model, batch)) / len(micro_batches)
            scaler.scale(loss).backward()
        loss_sum = loss.detach().float() if loss_sum is None else loss_sum + loss.detach().float()
    assert loss_sum is not None
    return loss_sum


def _reduction_deferred(model: nn.Module, defer: bool) -> contextlib.AbstractContextManager[object]:
    """Postpone what can wait for the last micro-batch without costing memory.

    DDP: the all-reduce (no_sync): each rank's gradients are full-size anyway. FSDP: nothing.
    Skipping its reduce-scatter would keep every parameter's *unsharded* gradient, upcast to the
    fp32 reduce dtype, until the last micro-batch
    (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, FSDPParamGroup.post_backward when
    reduce_grads is false; _fsdp_param.py, FSDPParam.to_accumulated_grad_if_needed): 4 bytes x all
    parameters on every rank, where reducing each micro-batch keeps only this rank's shard. HSDP:
    only the all-reduce across replicas waits (FSDPModule.set_requires_all_reduce;
    _fsdp_param_group.py all_reduce_grads), the reduce-scatter within a node still runs, as
    torchtitan does it.
    """
    if isinstance(model, DDP):
        return model.no_sync() if defer else contextlib.nullcontext()
    if is_sharded_model(model) and _replicated_across_groups(model):
        cast(Any, model).set_requires_all_reduce(not defer)
    return contextlib.nullcontext()


def _replicated_across_groups(model: nn.Module) -> bool:
    """Whether the model is sharded on a 2-D (replicate, shard) mesh: hsdp."""
    first = shard_of(next(model.parameters(), None))
    return first is not None and first.device_mesh.ndim == 2


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
