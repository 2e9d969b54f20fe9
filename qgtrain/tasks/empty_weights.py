"""Building a task's model without its weights, on the ranks that will be sent their shards of them.

Under fsdp, rank 0 builds the task as always and the other ranks build it with placeholder weights:
each parameter, as it is registered, is put on a scratch tensor shared by every parameter of its
shape and dtype, so the model's own initialisation runs for real on the placeholders, and is then
moved to the meta device. The modules, names, shapes and ties exist, datasets and buffers are built
for real (a non-persistent buffer, such as rotary frequencies, is never sent), and the memory is one
tensor per distinct shape: for a transformer, about one block. Rank 0 then sends each rank its
shards (training/parallel/initial_shards.py), so the initial weights are exactly those of one
full build.

Initialising for real, rather than on the meta device, keeps every random generator where a full
build leaves it: initialisation on meta tensors draws nothing, and some of torch's draws depend on
the values drawn (trunc_normal_ redraws what falls outside its bounds), so no replay could count
them. A task that splits its data with torch's global generator after building its model splits it
the same on every rank.

A pretrained model's skeleton is built on the meta device outright (`meta=True`): its weights are
read, not drawn, so nothing is initialised and nothing drawn, on rank 0 as on the others.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

_PLACEHOLDER = "_qgtrain_placeholder"
_state: dict[str, str] = {"mode": "off"}  # off, placeholders or meta


def is_building_empty() -> bool:
    """Inside `building_empty`: a pretrained model is then built from its config, its weights left
    unread."""
    return _state["mode"] != "off"


@contextlib.contextmanager
def building_empty(meta: bool = False) -> Iterator[None]:
    """Parameters registered inside get placeholder memory (or, with `meta`, none at all). Nested,
    it only switches between the two."""
    kept = _state["mode"]
    _state["mode"] = "meta" if meta else "placeholders"
    if kept != "off":
        try:
            yield
        finally:
            _state["mode"] = kept
        return
    original = nn.Module.register_parameter
    scratch: dict[tuple[object, ...], torch.Tensor] = {}

    def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(self, name, param)
        if (
            param is None
            or param.is_meta
            or getattr(param, _PLACEHOLDER, False)
            or isinstance(param, nn.parameter.UninitializedParameter)
        ):  # a tie (the same one again), a lazy one
            return
        if _state["mode"] == "meta":
            self._parameters[name] = type(param)(
                param.to("meta"), requires_grad=param.requires_grad
            )
            return
        key = (tuple(param.shape), param.stride(), param.dtype)
        if key not in scratch:
            scratch[key] = torch.empty_strided(param.shape, param.stride(), dtype=param.dtype)
        placeholder = type(param)(scratch[key], requires_grad=param.requires_grad)
        setattr(placeholder, _PLACEHOLDER, True)
        self._parameters[name] = placeholder

    nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
    try:
        yield
    finally:
        _state["mode"] = "off"
        nn.Module.register_parameter = original  # type: ignore[method-assign]


def to_meta(model: nn.Module) -> None:
    """Every parameter onto the meta device, ties kept (a placeholder's scratch is then freed)."""
    moved: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and not param.is_meta:
                if id(param) not in moved:
                    moved[id(param)] = type(param)(
                        param.to("meta"), requires_grad=param.requires_grad
                    )
                module._parameters[name] = moved[id(param)]
