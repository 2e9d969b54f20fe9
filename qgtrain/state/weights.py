"""Putting saved weights into a model: wrapper prefixes removed, and a mismatch said in the model's
terms.

Checkpoints hold the unwrapped model, but a state dict written elsewhere may carry DDP's `module.`
or torch.compile's `_orig_mod.` prefixes; both are stripped before loading. A model with adapters on
a frozen base (training/adapters.py) is saved and loaded by its trainable weights only: its base
comes from where it was built, and the checkpoint records which base that was.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import nn

from ..foundation.errors import CheckpointError

_WRAPPER_PREFIXES = ("module.", "_orig_mod.")
# set on a model with adapters: {"base": its identity, "lora": its settings}
ADAPTER_ATTRIBUTE = "qgtrain_adapter"


def adapter_of(model: nn.Module) -> dict[str, Any] | None:
    return getattr(model, ADAPTER_ATTRIBUTE, None)


def saved_state(model: nn.Module) -> dict[str, Any]:
    """What a checkpoint holds of the model: its state, or an adapted model's trainable weights."""
    state = model.state_dict()
    if adapter_of(model) is None:
        return state
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {name: value for name, value in state.items() if name in trainable}


def check_base(saved: dict[str, Any] | None, model: nn.Module, source: Path) -> None:
    """A checkpoint of adapters fits only the base they were trained on (a full one no adapter)."""
    before, now = (saved or {}).get("base"), (adapter_of(model) or {}).get("base")
    if before != now:
        named = {**(before or {}), **(now or {})}
        key = "model.pretrained" if "pretrained" in named else "model.adapter"
        raise CheckpointError(
            f"{key}: {source} was trained on {describe(before)}, this run "
            f"has {describe(now)}. HINT: resume on the base it was trained "
            "on, or start afresh (checkpoint.resume: never)"
        )


def describe(identity: dict[str, Any] | None) -> str:
    """A base's identity (training/adapters.py base_identity) in a message."""
    if not identity:
        return "no adapter (every weight trained)"
    if "pretrained" in identity:
        files = identity["weights"][:12]
        return f"model.pretrained {identity['pretrained']} (weight files {files})"
    return (
        f"the model built from {identity['built']} (shapes {identity['shapes'][:12]}) "
        f"with train.seed {identity['seed']}"
    )


def strip_wrapper_prefixes(state: Mapping[str, Any]) -> dict[str, Any]:
    """State-dict keys without `module.`/`_orig_mod.`, for checkpoints written by wrapped models
    elsewhere."""
    out = {}
    for key, value in state.items():
        while key.startswith(_WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def load_weights(model: nn.Module, state: dict[str, Any], source: Path) -> None:
    """Load weights, or say exactly how the checkpoint's model differs from the configured one."""
    own = saved_state(model)
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    shapes = [
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
        for k in own
        if k in state and state[k].shape != own[k].shape
    ]
    if missing or extra or shapes:
        parts = (
            ([f"shapes differ ({'; '.join(shapes[:3])})"] if shapes else [])
            + ([f"missing from the checkpoint: {', '.join(missing[:5])}"] if missing else [])
            + ([f"not in the model: {', '.join(extra[:5])}"] if extra else [])
        )
        raise CheckpointError(
            f"{source} does not fit the configured model: {'; '.join(parts)}. HINT: resume "
            "with the model settings it was trained with, or set checkpoint.resume: never"
        )
    model.load_state_dict(state, strict=adapter_of(model) is None)


def within_budget(sizes: Iterable[tuple[str, int]], budget: int) -> list[list[str]]:
    """Names in order, cut into consecutive groups of at most `budget` bytes (a larger one alone):
    how weights are moved, built or written a bounded piece at a time."""
    groups: list[list[str]] = [[]]
    held = 0
    for name, size in sizes:
        if groups[-1] and held + size > budget:
            groups.append([])
            held = 0
        groups[-1].append(name)
        held += size
    return [group for group in groups if group]
