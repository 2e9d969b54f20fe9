"""Moving a batch of any structure to the device, the way the user built it.

Tensors move; dicts, lists, tuples (named ones too) and dataclasses are rebuilt around their moved
contents; any other object with a `.to(device)` (a PyTorch Geometric Batch) moves itself, told
non_blocking=True where its `.to` takes it (PyG's BaseData.to does). Every copy is asynchronous,
which pays where the host side is pinned: the DataLoader pins tensors, containers and objects with
their own `pin_memory()` (PyG's) on CUDA, but not a dataclass
(torch/utils/data/_utils/pin_memory.py), whose fields then copy from pageable memory. Plain values
(numbers, text, None, numpy arrays) stay as they are. Anything else cannot be placed on a device by
us, and saying so at the first step beats a device mismatch deep inside the model.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..foundation.errors import TaskError

_PLAIN = (int, float, bool, str, bytes, type(None))


def to_device(batch: Any, device: torch.device, where: tuple[tuple[str, Any], ...] = ()) -> Any:
    """`batch` with every tensor on `device` (non-blocking: pinned CPU memory copies
    asynchronously). `where` is the path to this part of the batch, turned into text only for an
    error."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, _PLAIN) or type(batch).__module__ == "numpy":
        return batch
    if isinstance(batch, Mapping):
        rebuild: Any = type(batch)
        return rebuild({k: to_device(v, device, (*where, ("key", k))) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(
            *(to_device(v, device, (*where, ("attr", n))) for n, v in zip(batch._fields, batch))
        )
    if isinstance(batch, (list, tuple)):
        return type(batch)(
            to_device(v, device, (*where, ("index", i))) for i, v in enumerate(batch)
        )
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        moved = {
            f.name: to_device(getattr(batch, f.name), device, (*where, ("attr", f.name)))
            for f in dataclasses.fields(batch)
            if f.init
        }
        return dataclasses.replace(batch, **moved)
    if callable(move := getattr(batch, "to", None)):
        return move(device, non_blocking=True) if takes_non_blocking(move) else move(device)
    raise TaskError(
        f"task: the batch{_path(where)} is a {type(batch).__module__}.{type(batch).__qualname__}, "
        f"which qgtrain cannot move to {device}. HINT: make the collate return tensors, or dicts, "
        "lists, tuples or dataclasses of them, or give the class a .to(device) method"
    )


def takes_non_blocking(method: Callable[..., Any]) -> bool:
    """Whether a `.to` accepts non_blocking= (by name, or through **kwargs); asked once per
    class."""
    function = getattr(method, "__func__", None)  # a method: the same for every batch of its class
    return _accepts(function) if function is not None else _accepts.__wrapped__(method)


@functools.cache
def _accepts(function: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: do not guess
        return False
    return any(
        p.name == "non_blocking" and p.kind != p.POSITIONAL_ONLY or p.kind == p.VAR_KEYWORD
        for p in parameters
    )


def _path(where: tuple[tuple[str, Any], ...]) -> str:
    return "".join(
        f"[{key!r}]" if kind == "key" else f".{key}" if kind == "attr" else f"[{key}]"
        for kind, key in where
    )
