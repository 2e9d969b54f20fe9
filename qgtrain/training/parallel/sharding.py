"""FSDP2: which blocks of a model are its units (activation checkpointing, transforms.py, and
torch.compile checkpoint and compile the same blocks), and sharding them.

Blocks are found by class name: a Hugging Face model names them in `_no_split_modules` (GPT2Block,
LlamaDecoderLayer, ...); any other model names them with train.shard_modules. Each block is sharded
on its own, then the root (embeddings, head, norms), as torchtitan does: a block's weights are
gathered just before it runs and freed after, so a rank holds one block's full weights at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...foundation.errors import ConfigError
from ...runtime.precision import DTYPES
from ...tasks.lm_shape import cut_after_wrappers


def find_blocks(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The model's repeated blocks, outermost first; nested matches inside a block are not
    blocks."""
    wanted = set(names) or set(getattr(model, "_no_split_modules", None) or ())
    if not wanted:
        raise ConfigError(
            f"train.shard_modules: {type(model).__name__} does not name its blocks (it has no "
            "_no_split_modules); list the class names of its repeated blocks, e.g. "
            "train.shard_modules: [TransformerBlock]"
        )
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or module is model:
            continue
        if type(module).__name__ in wanted:
            blocks.append(module)
            inside.update(id(m) for m in module.modules())
    if not blocks:
        classes = sorted(
            {type(m).__name__ for m in model.modules() if m is not model and any(m.children())}
        )
        raise ConfigError(
            f"train.shard_modules: {type(model).__name__} has no module of class "
            f"{', '.join(sorted(wanted))}; its composite modules are {', '.join(classes[:12])}"
        )
    return blocks


def shard(
    model: nn.Module,
    blocks: Sequence[nn.Module],
    precision: str,
    device: torch.device,
    mesh: Any = None,
) -> nn.Module:
    """FSDP2 over all ranks (or the given mesh: 2-D for hsdp): each block, then the root. bf16
    computes in bf16 and reduces gradients in fp32, keeping fp32 weights and optimizer state (FSDP's
    own mixed precision, not autocast's).

    On a GPU the shards go where torch puts them, the current device (fully_shard takes no device),
    which the rank made its own before anything touched CUDA; init_device_mesh then leaves it as it
    is."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if device.type == "cuda" and torch.cuda.current_device() != device.index:
        raise RuntimeError(
            f"fsdp would place this rank's shards on cuda:{torch.cuda.current_device()}, not on "
            f"its own {device}: distributed.pick_device makes it current first"
        )

    mesh = mesh or init_device_mesh(device.type, (dist.get_world_size(),))
    policy = (
        MixedPrecisionPolicy(param_dtype=DTYPES[precision], reduce_dtype=torch.float32)
        if precision == "bf16"
        else MixedPrecisionPolicy()
    )
    for index, block in enumerate(blocks):
        # The last block's weights are needed again at once by backward: keeping them saves an
        # all-gather.
        fully_shard(
            block, mesh=mesh, mp_policy=policy, reshard_after_forward=index < len(blocks) - 1
        )
    fully_shard(model, mesh=mesh, mp_policy=policy)
    cut_after_wrappers(model)
    return model


def local_numel(tensors: Sequence[torch.Tensor]) -> int:
    """Elements this rank holds: a sharded tensor's own shard, a plain tensor whole."""
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).numel() for t in tensors)
