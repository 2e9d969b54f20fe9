"""The EMA of the weights in a checkpoint (train.ema_decay), and reading it back.

Replicated (ddp, one process): `ema.pt` beside model.pt, written by rank 0, the full fp32 average of
each trained parameter by name. Sharded (fsdp): entries `ema.<parameter>` of the state every rank
writes (sharded.py), each rank its own shards. A checkpoint without EMA (a run without it, or one
written before qgtrain had it) is exactly what it always was. Either kind loads into a model of
either kind, as the weights do: DCP reshards, and a full `ema.pt` is cut to a sharded model's shards
on every rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..foundation.errors import CheckpointError, first_line
from .checkpoint import Checkpoint, load_file
from .layout import EMA, EMA_KEY
from .sharded import FOLDER, fill_from_full, is_sharded_checkpoint

FILE = EMA
KEY = EMA_KEY


def names(ckpt: Checkpoint) -> set[str]:
    """The parameters whose average the checkpoint holds (none without EMA)."""
    if is_sharded_checkpoint(ckpt):
        from .dcp_safe import read_metadata

        prefix = f"{KEY}."
        return {
            fqn.removeprefix(prefix)
            for fqn in read_metadata(ckpt).state_dict_metadata
            if fqn.startswith(prefix)
        }
    if FILE not in ckpt.manifest.get("files", {}):
        return set()
    return set(load_file(ckpt, FILE))


def saved(ckpt: Checkpoint) -> bool:
    if is_sharded_checkpoint(ckpt):
        return bool(names(ckpt))
    return FILE in ckpt.manifest.get("files", {})


def load(ckpt: Checkpoint, averages: dict[str, torch.Tensor]) -> bool:
    """Fill `averages` (plain tensors, or a sharded model's DTensors) in place from the checkpoint,
    a collective for a sharded one; False, untouched, if it holds no EMA."""
    if not saved(ckpt):
        return False
    if is_sharded_checkpoint(ckpt):
        _load_sharded(ckpt, {KEY: averages}, no_dist=False)
        return True
    fill(averages, load_file(ckpt, FILE), ckpt.path / FILE)
    return True


def fill(averages: dict[str, torch.Tensor], full: dict[str, Any], source: Path) -> None:
    """Full saved averages (ema.pt's) into `averages` in place, each checked against its shape."""
    for name, average in averages.items():
        if name not in full or tuple(full[name].shape) != tuple(average.shape):
            found = tuple(full[name].shape) if name in full else "nothing"
            raise CheckpointError(
                f"{source} holds {found} for {name}, the model "
                f"{tuple(average.shape)}. HINT: resume with the model settings "
                "it was trained with, or set checkpoint.resume: never"
            )
        fill_from_full(average, full[name])


def reader(ckpt: Checkpoint) -> Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """Full fp32 averages for the names asked (meta tensors give the shapes), in one process on the
    CPU, a group at a time: for export."""
    if not is_sharded_checkpoint(ckpt):
        full = load_file(ckpt, FILE)  # mmap: read as asked
        return lambda wanted: {name: full[name] for name in wanted}
    from . import dcp_safe

    safe = dcp_safe.SafeReader(ckpt)  # the metadata read and checked once for every group

    def read(wanted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        empty = {name: torch.empty(t.shape, dtype=torch.float32) for name, t in wanted.items()}
        state = {KEY: empty}
        _load_sharded(ckpt, state, no_dist=True, reader=safe)
        return state[KEY]

    return read


def _load_sharded(
    ckpt: Checkpoint, state: dict[str, Any], no_dist: bool, reader: Any = None
) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from . import dcp_safe  # never DCP's own reader: it unpickles whatever the folder holds

    try:
        dcp_safe.load(ckpt, state, reader=reader, no_dist=no_dist)
    except (CheckpointException, RuntimeError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"{ckpt.path / FOLDER}: its EMA of the weights does not fit the "
            f"model ({first_line(exc)}). HINT: resume with the model settings it "
            "was trained with, or set checkpoint.resume: never"
        ) from None
