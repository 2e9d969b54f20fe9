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
the saved model gives. Which of these a run needs is its strategy's answer (strategy.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ...foundation.errors import TaskError
from ...runtime import diagnose, distributed

IGNORE_ATTRIBUTE = "_ddp_params_and_buffers_to_ignore"


def broadcast_by_ddp(wrapped: DDP) -> list[torch.Tensor]:
    """The buffers DDP copies from rank 0 at each training forward, chosen as DDP chooses them."""
    if not wrapped.broadcast_buffers:
        return []
    return [
        b for name, b in wrapped.module.named_buffers() if name not in wrapped.parameters_to_ignore
    ]


def check_start_replicated(model: nn.Module, device: torch.device) -> None:
    """Before DDP wraps the model (a collective): DDP copies rank 0's parameters and buffers when
    it wraps the model, except those it ignores; refuse those if they differ across ranks."""
    ignored = set(getattr(model, IGNORE_ATTRIBUTE, ()))
    candidates = [
        (n, t) for n, t in [*model.named_parameters(), *model.named_buffers()] if n in ignored
    ]
    _refuse_differences(
        distributed.diverged(candidates, device),
        f"DDP does not copy them from rank 0 (they are in the model's {IGNORE_ATTRIBUTE}): a "
        "checkpoint would hold one rank's values",
        f", or take them out of {IGNORE_ATTRIBUTE}",
    )


def check_start_sharded(model: nn.Module, device: torch.device) -> None:
    """Before sharding (a collective): every rank gets its state_dict from rank 0 or a
    checkpoint, but keeps its own non-persistent buffers; refuse those if they differ."""
    saved = model.state_dict().keys()
    candidates = [(n, b) for n, b in model.named_buffers() if n not in saved and not b.is_meta]
    _refuse_differences(
        distributed.diverged(candidates, device),
        "no rank sends them under FSDP (they are not in the state_dict): the ranks would compute "
        "with different values",
        "",
    )


def _refuse_differences(differ: list[str], repair: str, hint: str) -> None:
    if differ:
        raise TaskError(
            f"task.factory: the model's {', '.join(differ[:5])} differ(s) across ranks "
            f"when the task is built, and {repair}. HINT: build them the same on every "
            f"rank (the task function runs with the same seed on each){hint}"
        )


def check_replicas_agree(model: nn.Module, wrapped: DDP, step: int, device: torch.device) -> None:
    """Every rank, before a checkpoint under DDP: stop if anything that no broadcast repairs
    differs (a frozen parameter changed on one rank, a buffer DDP ignores)."""
    repaired = {id(b) for b in broadcast_by_ddp(wrapped)}
    named = [
        *model.named_parameters(),
        *((n, b) for n, b in model.named_buffers() if id(b) not in repaired),
    ]
    differ = distributed.diverged(named, device)
    if differ:
        raise diagnose.diverged_replicas(step, differ)


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
