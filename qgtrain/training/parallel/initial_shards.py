"""The initial weights of a sharded model: rank 0's full build, sent to every rank as its shards.

No rank but rank 0 ever holds the whole model. Rank 0 builds the task as one process would (so the
weights are those of a ddp run or a one-process run with the same seed, bit for bit) and keeps its
full tensors aside; every rank shards a model whose parameters are on the meta device, gives its
shards memory on its device, and receives them from rank 0 one tensor at a time (torch's
`set_model_state_dict` with `broadcast_from_rank0`), a group of tensors at a time. Peak memory: rank
0 the model and a group's shards, every other rank its shards and one full tensor. A start that
resumes builds no weights at all: the checkpoint fills the shards.

The alternative, every rank building on the meta device and initialising its own shards
(`reset_parameters`, `_init_weights`), was measured too (bench/big_model.py) and not taken: random
initialisation of a shard is not the same slice of a full initialisation, so such a run could not be
reproduced across ddp, fsdp and rank counts.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from ...runtime import distributed
from ...state.weights import within_budget
from ...tasks.empty_weights import to_meta

log = logging.getLogger("qgtrain")
GROUP_BYTES = 64 << 20  # full tensors sent per call: each call costs a pass over the model's state


def set_aside_full_weights(model: nn.Module) -> dict[str, Any]:
    """Rank 0: the built model's full state, kept; its parameters then go to the meta device like
    every other rank's, ties kept, so all ranks shard the same empty model and no device ever holds
    it whole."""
    if any(p.is_meta for p in model.parameters()):
        return {}
    full = dict(model.state_dict())
    to_meta(model)
    return full


def fill(model: nn.Module, full: dict[str, Any], device: torch.device) -> None:
    """After sharding (a collective): give the meta shards memory on `device`, then, unless rank 0
    holds no weights (a resume), fill them from rank 0's `full` state. It is sent in groups of
    tensors, each group dropped from rank 0 once sent, so rank 0 never holds the whole model and all
    its shards at once."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model._apply(lambda t: torch.empty_like(t, device=device) if t.is_meta else t)
    if not distributed.broadcast_from_main(bool(full)):
        return
    log.info("sending every rank its shards of the initial weights built on rank 0")
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    for names in groups(model.state_dict()):  # the same groups on every rank: the same calls
        set_model_state_dict(
            model, {name: full.pop(name) for name in names if name in full}, options=options
        )
    full.clear()


def groups(state: dict[str, Any], budget: int = GROUP_BYTES) -> list[list[str]]:
    """State names in order, in groups of at most `budget` bytes of full tensors (or one tensor)."""
    return within_budget(
        (
            (
                name,
                tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0,
            )
            for name, tensor in state.items()
        ),
        budget,
    )
