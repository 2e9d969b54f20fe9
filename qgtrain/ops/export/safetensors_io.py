"""A checkpoint's weights into safetensors files tensor by tensor, and checked back the same way.

The exporting process never holds the model: names, shapes and ties come from the model rebuilt
without weights (tasks/empty_weights.py); the tensors are read from the checkpoint a group at a time
(a sharded checkpoint's pieces of each tensor assembled by torch.distributed.checkpoint, or a
replicated model.pt through mmap), converted to the export dtype and appended to the file whose
header was written first. Files are sharded by size as transformers shards them
(`model-00001-of-0000n.safetensors` and `model.safetensors.index.json`). The check reads every
tensor back through safetensors, as a loader does, and compares it with the checkpoint's, converted
alike: equal, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...foundation.errors import CheckpointError, QgtrainError, first_line
from ...state import checkpoint, layout, sharded
from ...state.weights import strip_wrapper_prefixes, within_budget

# meta tensors in, full tensors out
Reader = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
INDEX = "model.safetensors.index.json"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_NAMES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def tensors_to_write(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state (meta tensors), each tie once: the first name of tensors that share a
    parameter (transformers keeps transformer.wte.weight and drops lm_head.weight the same way)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[name] = tensor
    return out


def converted(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A floating-point tensor in the export dtype; integers and flags as they are."""
    return tensor.to(dtype) if tensor.is_floating_point() else tensor


def checkpoint_reader(ckpt: checkpoint.Checkpoint) -> Reader:
    """Full tensors from a checkpoint of either kind, for the names asked."""
    if not sharded.is_sharded_checkpoint(ckpt):
        # memory-mapped: each tensor is read as it is asked for
        saved = strip_wrapper_prefixes(checkpoint.load_file(ckpt, layout.MODEL))

        def pick(wanted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            missing = sorted(set(wanted) - set(saved))
            if missing:
                raise CheckpointError(
                    f"{ckpt.path / 'model.pt'} does not hold {', '.join(missing[:5])} of the "
                    "model built from the checkpoint's config"
                )
            return {name: saved[name] for name in wanted}

        return pick
    from torch.distributed.checkpoint.api import CheckpointException

    from ...state import dcp_safe  # never DCP's own reader: it unpickles whatever the folder holds

    reader = dcp_safe.SafeReader(ckpt)  # the metadata read and checked once for every group

    def read(wanted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = {"model": {name: torch.empty(t.shape, dtype=t.dtype) for name, t in wanted.items()}}
        try:
            dcp_safe.load(ckpt, state, reader=reader, no_dist=True)
        except (CheckpointException, RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"{ckpt.path / sharded.FOLDER} does not fit the model built from the "
                f"checkpoint's config ({first_line(exc)})"
            ) from None
        return state["model"]

    return read


def groups(
    names: list[str], meta: dict[str, torch.Tensor], read: Reader, budget: int
) -> Iterator[dict[str, torch.Tensor]]:
    """The tensors of `names`, read a group of at most `budget` bytes (or one tensor) at a time."""
    for group in within_budget(((name, _nbytes(meta[name])) for name in names), budget):
        yield read({n: meta[n] for n in group})


def write_weights(
    folder: Path, meta: dict[str, torch.Tensor], read: Reader, dtype: torch.dtype, max_bytes: int
) -> list[str]:
    """Write every tensor of `meta` into safetensors files in `folder`; returns the file names."""
    sizes = [(name, _nbytes(converted(t, dtype))) for name, t in meta.items()]
    plan = within_budget(sizes, max_bytes)
    names = (
        ["model.safetensors"]
        if len(plan) == 1
        else [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    )
    budget = max(_nbytes(t) for t in meta.values())
    for file_name, in_file in zip(names, plan):
        with open(folder / file_name, "wb") as f:
            f.write(_header({n: converted(meta[n], dtype) for n in in_file}))
            for group in groups(in_file, meta, read, budget):
                for name in in_file:
                    if name in group:
                        f.write(
                            converted(group[name], dtype)
                            .contiguous()
                            .reshape(-1)
                            .view(torch.uint8)
                            .numpy()
                            .data
                        )
    if len(plan) > 1:
        weight_map = {n: file_name for file_name, in_file in zip(names, plan) for n in in_file}
        (folder / INDEX).write_text(
            json.dumps(
                {"metadata": {"total_size": sum(s for _, s in sizes)}, "weight_map": weight_map},
                indent=2,
            )
            + "\n"
        )
    return names


def check_weights(
    folder: Path, meta: dict[str, torch.Tensor], read: Reader, dtype: torch.dtype
) -> int:
    """Every tensor read back from the files equals the checkpoint's, converted alike; returns how
    many."""
    from safetensors import safe_open

    index = folder / INDEX
    where = (
        json.loads(index.read_text())["weight_map"]
        if index.exists()
        else dict.fromkeys(meta, "model.safetensors")
    )
    if set(where) != set(meta):
        raise QgtrainError(
            f"export: the files in {folder} hold {len(where)} tensors, the model {len(meta)}; the "
            "export was not kept"
        )
    checked = 0
    for group in groups(list(meta), meta, read, max(_nbytes(t) for t in meta.values())):
        # safetensors maps the file: reopened per group, so only the
        with contextlib.ExitStack() as opened:
            # group's pages stay mapped
            files = {
                name: opened.enter_context(safe_open(folder / name, "pt"))
                for name in sorted({where[n] for n in group})
            }
            for name, tensor in group.items():
                if not torch.equal(files[where[name]].get_tensor(name), converted(tensor, dtype)):
                    raise QgtrainError(
                        f"export: {name} in {folder / where[name]} differs from the checkpoint's "
                        "after reloading; the export was not kept"
                    )
                checked += 1
    return checked


def _header(tensors: dict[str, torch.Tensor]) -> bytes:
    """The safetensors header: 8 bytes of length, then JSON padded with spaces to 8-byte
    alignment."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _NAMES:
            raise QgtrainError(
                f"export: {name} has dtype {tensor.dtype}, which safetensors cannot hold"
            )
        entries[name] = {
            "dtype": _NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + _nbytes(tensor)],
        }
        offset += _nbytes(tensor)
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def _nbytes(tensor: torch.Tensor) -> int:
    return math.prod(tensor.shape) * tensor.element_size()
