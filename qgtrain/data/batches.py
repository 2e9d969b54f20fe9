"""Moving a batch of any structure to the device, the way the user built it.

Tensors move; dicts, lists, tuples (named ones too) and dataclasses are rebuilt around their moved
contents; any other object with a `.to(device)` (a PyTorch Geometric Batch) moves itself. Plain values
(numbers, text, None, numpy arrays) stay as they are. Anything else cannot be placed on a device by
us, and saying so at the first step beats a device mismatch deep inside the model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import ConfigError

_PLAIN = (int, float, bool, str, bytes, type(None))


def to_device(batch: Any, device: torch.device, where: str = "batch") -> Any:
    """`batch` with every tensor on `device` (non-blocking: pinned CPU memory copies asynchronously)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, _PLAIN) or type(batch).__module__ == "numpy":
        return batch
    if isinstance(batch, Mapping):
        rebuild: Any = type(batch)
        return rebuild({k: to_device(v, device, f"{where}[{k!r}]") for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(to_device(v, device, f"{where}.{n}") for n, v in zip(batch._fields, batch)))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, f"{where}[{i}]") for i, v in enumerate(batch))
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        moved = {f.name: to_device(getattr(batch, f.name), device, f"{where}.{f.name}")
                 for f in dataclasses.fields(batch) if f.init}
        return dataclasses.replace(batch, **moved)
    if callable(getattr(batch, "to", None)):
        return batch.to(device)
    raise ConfigError(
        f"task: the {where} is a {type(batch).__module__}.{type(batch).__qualname__}, which qgtrain cannot move "
        f"to {device}. HINT: make the collate return tensors, or dicts, lists, tuples or dataclasses of them, "
        "or give the class a .to(device) method")
