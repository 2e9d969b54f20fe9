"""The optimizer: AdamW with weight decay on matrices only, and global-norm gradient clipping."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import OptimConfig
from ..state.sharded import shard_of


def adamw(model: nn.Module, optim: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """Biases and norm gains are not decayed (nanoGPT's grouping); fused kernels on GPUs."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused=False would also switch off torch's default multi-tensor (foreach) kernels: say nothing on CPU
    fused = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, **fused)


def clip_gradients(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Clip to max_norm (0 = never) and return the norm before clipping, as a tensor (no host sync).

    Sharded (FSDP) gradients give each rank the norm of its shards: the global norm is reduced over the
    ranks before clipping, so every rank clips by the same factor as an unsharded run would.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    if (sharded := shard_of(norm)) is not None:
        norm = sharded.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm if max_norm > 0 else math.inf, norm)
    return norm
