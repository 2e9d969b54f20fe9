"""`qgtrain export RUN --weights ema`: the EMA of the weights written in place of the trained ones.

The export reads a checkpoint through a Reader (safetensors_io.py: meta tensors in, full tensors
out); this one answers each trained parameter with its average and everything else (buffers, frozen
parameters, which are not averaged) with the checkpoint's model, so writing, the bit-for-bit check
and the reload comparison all see the same weights. A tied parameter is asked for by its first name
in the state dict and found by identity, whatever name the average was saved under."""

from __future__ import annotations

import torch
from torch import nn

from ...state import ema_files
from ...state.checkpoint import Checkpoint
from .safetensors_io import Reader


def averaged(ckpt: Checkpoint, model: nn.Module, read: Reader) -> Reader:
    """`read`, with every parameter the checkpoint holds an average of answered by that average."""
    held = ema_files.names(ckpt)
    by_id = {id(p): name for name, p in model.named_parameters() if name in held}
    read_average = ema_files.reader(ckpt)

    def read_both(wanted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        average_of = {name: by_id[id(t)] for name, t in wanted.items() if id(t) in by_id}
        rest = {name: t for name, t in wanted.items() if name not in average_of}
        got = read(rest) if rest else {}
        asked = {average_of[name]: wanted[name] for name in average_of}
        averages = read_average(asked) if asked else {}
        got.update({name: averages[average_of[name]] for name in average_of})
        return {name: got[name] for name in wanted}

    return read_both
