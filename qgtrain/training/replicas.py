"""What the ranks' copies of a model must agree on, and where qgtrain makes them agree because torch
does not.

DDP keeps parameters equal (one start, all-reduced gradients) and, with `broadcast_buffers` (torch's
default, and qgtrain's), copies rank 0's buffers to every rank at the start of each training
forward: all of the module's `named_buffers()`, persistent or not, except those named in
`_ddp_params_and_buffers_to_ignore` (torch/nn/parallel/distributed.py, `_assign_modules_buffers`).
Between two forwards those buffers differ legitimately (batch norm's running statistics follow each
rank's own batch), so the check before a checkpoint compares the parameters and the buffers DDP
leaves alone. The checkpoint holds rank 0's buffers: the values every rank takes at its next
forward, so a resumed rank continues as it would have.

FSDP2 broadcasts nothing, and a sharded checkpoint keeps one copy of a replicated buffer: every rank
takes rank 0's buffers before a checkpoint. Rank 0's own buffers never change by that, so batch
norm's statistics come out as under DDP. Evaluation runs on the unwrapped module, where DDP
broadcasts nothing either: every rank takes rank 0's buffers first, so a reported metric is the one
the saved model gives.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..foundation.errors import TaskError
from ..runtime import diagnose, distributed
from ..state.sharded import is_sharded_model

log = logging.getLogger("qgtrain")
IGNORE_ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"


def broadcast_by_ddp(wrapped: nn.Module) -> list[torch.Tensor]:
    """The buffers DDP copies from rank 0 at each training forward, chosen as DDP chooses them."""
    if not isinstance(wrapped, DDP) or not wrapped.broadcast_buffers:
        return []
    return [
        b for name, b in wrapped.module.named_buffers() if name not in wrapped.parameters_to_ignore
    ]


def check_start(model: nn.Module, parallel: str, device: torch.device, world_size: int) -> None:
    """Before wrapping (a collective): refuse tensors that differ across ranks and that nothing will
    make equal. DDP copies rank 0's parameters and buffers when it wraps the model, except those it
    ignores; under FSDP every rank gets its state_dict from rank 0 or a checkpoint, but keeps its
    own non-persistent buffers."""
    if world_size == 1:
        return
    ignored = set(getattr(model, IGNORE_ATTRIBUTE, ()))
    # rank 0 (or a checkpoint) gives the state_dict; the rest is each rank's
    if parallel in ("fsdp", "hsdp"):
        saved = model.state_dict().keys()
        candidates = [(n, b) for n, b in model.named_buffers() if n not in saved and not b.is_meta]
    else:
        candidates = [
            (n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if n in ignored
        ]
    differ = distributed.diverged(candidates, device)
    if not differ:
        return
    repair = (
        "no rank sends them under FSDP (they are not in the state_dict): the ranks would compute "
        "with different values"
        if parallel != "ddp"
        else f"DDP does not copy them from rank 0 (they are in the "
        f"model's {IGNORE_ATTRIBUTE}): a checkpoint would hold one rank's values"
    )
    raise TaskError(
        f"task.factory: the model's {', '.join(differ[:5])} differ(s) across ranks "
        f"when the task is built, and {repair}. HINT: build them the same on every "
        "rank (the task function runs with the same seed on each)"
        + ("" if parallel != "ddp" else f", or take them out of {IGNORE_ATTRIBUTE}")
    )


def agree_before_save(
    model: nn.Module, wrapped: nn.Module, step: int, device: torch.device
) -> None:
    """Every rank, before a checkpoint: under FSDP take rank 0's buffers; under DDP stop if anything
    that no broadcast repairs differs (a frozen parameter changed on one rank, a buffer DDP
    ignores)."""
    if dist.get_world_size() == 1:
        return
    if is_sharded_model(model):
        take_main_values(list(model.buffers()))
        return
    repaired = {id(b) for b in broadcast_by_ddp(wrapped)}
    named = [
        *model.named_parameters(),
        *((n, b) for n, b in model.named_buffers() if id(b) not in repaired),
    ]
    differ = distributed.diverged(named, device)
    if differ:
        raise diagnose.diverged_replicas(step, differ)


def agree_before_evaluation(model: nn.Module, wrapped: nn.Module) -> None:
    """Every rank evaluates with rank 0's buffers (those DDP would copy at the next forward; under
    FSDP all)."""
    if dist.get_world_size() > 1:
        take_main_values(
            list(model.buffers()) if is_sharded_model(model) else broadcast_by_ddp(wrapped)
        )


@torch.no_grad()
def take_main_values(tensors: Sequence[torch.Tensor]) -> None:
    """Rank 0's values into these tensors on every rank, in place: one broadcast per dtype and
    device."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for group in groups.values():
        flat = torch.cat([t.reshape(-1) for t in group])
        dist.broadcast(flat, src=0)
        for tensor, value in zip(group, flat.split([t.numel() for t in group])):
            tensor.copy_(value.view_as(tensor))


def sync_batchnorm_problem(parallel: str, device_type: str, world_size: int) -> str | None:
    """Why train.sync_batchnorm cannot run here, or None. torch 2.13's SyncBatchNorm computes on
    GPUs only (its forward refuses CPU input, and DDP refuses CPU modules that hold one)."""
    if world_size == 1:
        return None  # one rank's batch is the global batch: nothing is converted
    if parallel != "ddp":
        return (
            "train.sync_batchnorm: applies to train.parallel: ddp; with fsdp each rank normalizes "
            "by its own batch. HINT: set train.sync_batchnorm: false, or train with ddp"
        )
    if device_type == "cpu":
        return (
            "train.sync_batchnorm: SyncBatchNorm runs on GPUs only (torch refuses CPU tensors), "
            f"and these {world_size} ranks train on the CPU. HINT: set train.sync_batchnorm: false "
            "(each rank then normalizes by its own batch, and the running statistics are rank "
            "0's), or train on GPUs"
        )
    return None


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
