"""Wrapping the user's module for data-parallel training: torch.compile, then DDP across ranks."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..runtime import distributed
from ..runtime.rendezvous import DistEnv


def wrap(model: nn.Module, env: DistEnv, device: torch.device, compile_model: bool,
         find_unused_parameters: bool) -> nn.Module:
    """What forward and backward go through. `model` must already be on `device`.

    DDP gets the local rank as an integer device id (never a torch.device, never the global rank); one
    process is not wrapped at all, so a laptop run has no DDP overhead.
    """
    compiled = cast(nn.Module, torch.compile(model)) if compile_model else model
    if env.world_size == 1:
        return compiled
    return DDP(compiled, device_ids=distributed.ddp_device_ids(env, device),
               find_unused_parameters=find_unused_parameters, gradient_as_bucket_view=True)
