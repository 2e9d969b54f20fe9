"""Sharded checkpoints (FSDP): the model and optimizer written by every rank at once, as its own
shard.

torch.distributed.checkpoint (DCP) writes one file per rank plus a `.metadata` index into `sharded/`
inside the staging folder. Each file gets a manifest entry (size, checksum) like any other, so
commit, verification, rotation and the refusal of incomplete checkpoints treat it as they treat
model.pt. DCP records where each shard lies in the full tensor, so a sharded checkpoint loads on any
number of ranks, sharded or not, and a replicated one (model.pt, optim.pt from ddp) loads into a
sharded model: the two modes resume each other.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..foundation.errors import CheckpointError, first_line
from .checkpoint import Checkpoint, file_entry, load_file
from .layout import MODEL, OPTIM, SHARDED, SHARDED_METADATA
from .weights import adapter_of, load_weights, strip_wrapper_prefixes

FOLDER = SHARDED


def dcp_error() -> type[BaseException]:
    """What torch.distributed.checkpoint raises on every rank when one rank's write fails (a
    BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return CheckpointException


def is_sharded_checkpoint(ckpt: Checkpoint) -> bool:
    return SHARDED_METADATA in ckpt.manifest.get("files", {})


def shard_of(tensor: Any) -> Any:
    """A DTensor (a shard with its place in the full tensor), or None; asked without importing
    DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return tensor if module is not None and isinstance(tensor, module.DTensor) else None


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's state keyed by parameter name: this rank's shards (DTensors)
    under FSDP."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=shard_options(model))
    return {"model": model_state, "optim": optim_state}


def shard_options(model: nn.Module) -> Any:
    """DCP's options for a model's state: an adapted model's frozen base is not saved."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=adapter_of(model) is not None)


def write(
    staging: Path, state: dict[str, Any], rank: int, group: dist.ProcessGroup
) -> dict[str, Any]:
    """Every rank writes its shard (a collective on `group`); returns this rank's manifest
    entries."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    folder = staging / FOLDER
    folder.mkdir(exist_ok=True)
    save(
        state,
        storage_writer=FileSystemWriter(
            folder, single_file_per_rank=True, sync_files=False, thread_count=1
        ),
        process_group=group,
    )
    mine = sorted(p for p in folder.iterdir() if p.name.startswith(f"__{rank}_"))
    if rank == 0:
        mine.append(staging / SHARDED_METADATA)
    return {f"{FOLDER}/{path.name}": file_entry(path) for path in mine}


def load(ckpt: Checkpoint, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Put a checkpoint of either kind into a model of either kind (a collective under FSDP)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if is_sharded_checkpoint(ckpt):
        from torch.distributed.checkpoint.api import CheckpointException

        from . import dcp_safe  # never DCP's own reader: it unpickles whatever the folder holds

        state = sharded_state(model, optimizer)
        try:
            dcp_safe.load(ckpt, state)
        except (CheckpointException, RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"{ckpt.path / FOLDER} does not fit the configured model and optimizer "
                f"({first_line(exc)}). HINT: resume with the model settings it was trained "
                "with, or set checkpoint.resume: never"
            ) from None
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=StateDictOptions(strict=adapter_of(model) is None),
        )
        return
    # A replicated checkpoint into a sharded model: every rank reads the full state and keeps its
    # shards.
    full = StateDictOptions(full_state_dict=True, strict=adapter_of(model) is None)
    names = _names_by_index(model, optimizer)
    saved = load_file(ckpt, OPTIM)["optimizer"]
    by_name: dict[str, Any] = {
        "state": {names[int(i)]: value for i, value in saved["state"].items()},
        "param_groups": [
            {**group, "params": [names[i] for i in group["params"]]}
            for group in saved["param_groups"]
        ],
    }
    try:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=load_file(ckpt, MODEL),
            optim_state_dict=by_name,
            options=full,
        )
    except (RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"{ckpt.path} does not fit the configured model and optimizer "
            f"({first_line(exc)}). HINT: resume with the model settings it was trained with, "
            "or set checkpoint.resume: never"
        ) from None


def _names_by_index(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's order, the order optim.pt's integer ids follow."""
    names = {id(param): name for name, param in model.named_parameters()}
    return [names[id(param)] for group in optimizer.param_groups for param in group["params"]]


def load_model(ckpt: Checkpoint, model: nn.Module) -> None:
    """The checkpoint's full weights into an unsharded model, in place, in one process (export): a
    sharded checkpoint's shards are read straight into the model's own tensors, so no second copy is
    ever held."""
    if not is_sharded_checkpoint(ckpt):
        load_weights(model, strip_wrapper_prefixes(load_file(ckpt, MODEL)), ckpt.path)
        return
    from torch.distributed.checkpoint.api import CheckpointException

    from . import dcp_safe

    try:
        dcp_safe.load(ckpt, {"model": model.state_dict()}, no_dist=True)
    except (CheckpointException, RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"{ckpt.path / FOLDER} does not fit the model built from the checkpoint's config "
            f"({first_line(exc)})"
        ) from None


def load_own_shards(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    saved_model: dict[str, Any],
    saved_optim: dict[str, Any],
) -> None:
    """This rank's shards as the node-local tier saved them (plain tensors) back into the same
    shards: same ranks, same layout, nothing resharded."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    state = sharded_state(model, optimizer)  # the optimizer's state made, as DCP's load makes it
    try:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=_into(state["model"], saved_model),
            optim_state_dict=_into(state["optim"], saved_optim),
            options=StateDictOptions(strict=adapter_of(model) is None),
        )
    except (RuntimeError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"a node-local checkpoint does not fit the configured model and optimizer "
            f"({first_line(exc)}). HINT: resume with the model settings it was trained with"
        ) from None


def fill_from_full(tensor: torch.Tensor, full: torch.Tensor) -> None:
    """A full tensor into a plain one, or into a DTensor's shard: every rank cuts its own part of
    the same full tensor (no communication), as the placement says."""
    shard = shard_of(tensor)
    if shard is None:
        tensor.copy_(full)
        return
    from torch.distributed.tensor import distribute_tensor

    local = shard.to_local()
    cut = distribute_tensor(
        full.to(local.device), shard.device_mesh, shard.placements, src_data_rank=None
    )
    local.copy_(cut.to_local())


def fill_own_shards(averages: dict[str, Any], saved: dict[str, Any]) -> None:
    """The EMA's averages (this rank's shards) from the node-local tier's plain tensors, in
    place."""
    _into(averages, saved)


def _into(current: Any, saved: Any) -> Any:
    """`saved`'s structure and values, each tensor copied into the one `current` holds in its place
    (its local shard for a DTensor), so a shard keeps its place in the whole."""
    if isinstance(saved, torch.Tensor):
        if not isinstance(current, torch.Tensor):
            return saved
        shard = shard_of(current)
        (shard.to_local() if shard is not None else current).copy_(saved)
        return current
    if isinstance(saved, dict):
        mapping = current if isinstance(current, dict) else {}
        return {key: _into(mapping.get(key), value) for key, value in saved.items()}
    if isinstance(saved, (list, tuple)):
        items = current if isinstance(current, (list, tuple)) else [None] * len(saved)
        return type(saved)(_into(c, v) for c, v in zip(items, saved))
    return saved
