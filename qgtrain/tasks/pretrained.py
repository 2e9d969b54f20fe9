"""A pretrained folder as the model to fine-tune: checked against its own config, read by one rank.

Before any weight is read, the folder's safetensors headers (names, shapes) are compared with the
model its config.json builds, so a folder whose weights do not fit its config is refused in one line
naming the tensor (transformers would print a table and raise). Under fsdp only rank 0 opens the
weights; the other ranks read config.json alone, build the model without weights (empty_weights.py)
and are sent their shards (training/parallel/initial_shards.py): the folder is read once per job,
not once per rank, and rank 0's refusal is every rank's (tasks/build.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..foundation.errors import ConfigError, first_line
from ..foundation.folder_code import remote_code
from .empty_weights import building_empty, is_building_empty


def load_pretrained(path: Path) -> nn.Module:
    import transformers

    if not (path / "config.json").is_file():
        raise ConfigError(
            f"model.pretrained: {path} has no config.json; expected a folder written by "
            "save_pretrained (e.g. by `qgtrain export`)"
        )
    code = remote_code(path, "model.pretrained")  # a folder naming code is refused here
    try:
        config = transformers.AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=code
        )
        with building_empty(meta=True):  # nothing initialised, nothing drawn: as from_pretrained
            skeleton = transformers.AutoModelForCausalLM.from_config(
                config, dtype=torch.float32, trust_remote_code=code
            )
        if is_building_empty():
            return skeleton
        problem = shape_problem(path, dict(skeleton.state_dict()))
        if problem:
            raise ConfigError(
                f"model.pretrained: {problem}. HINT: give the folder as save_pretrained wrote it, "
                "or fix its config.json to describe its weights"
            )
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32, trust_remote_code=code
        )
        # from_pretrained gives eval mode, for inference: its dropout would be off
        return model.train()
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"model.pretrained: cannot load {path}: {first_line(exc)}") from None


def shape_problem(folder: Path, model_state: dict[str, Any]) -> str | None:
    """The first tensor, in the model's order, whose shape in the folder's safetensors differs from
    the model's, or None (also for a folder without safetensors: from_pretrained then checks what it
    reads)."""
    from safetensors import safe_open

    saved: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in safetensors_files(folder):
        with safe_open(folder / name, "pt") as f:
            saved.update({key: (name, tuple(f.get_slice(key).get_shape())) for key in f.keys()})
    for key, tensor in model_state.items():
        if key in saved and saved[key][1] != tuple(tensor.shape):
            return (
                f"{folder / saved[key][0]} holds {key} of shape {saved[key][1]}, but the model its "
                f"config.json describes has {tuple(tensor.shape)}"
            )
    return None


def safetensors_files(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return sorted(set(json.loads(index.read_text())["weight_map"].values()))
    return ["model.safetensors"] if (folder / "model.safetensors").is_file() else []


def weight_files(folder: Path) -> list[str]:
    """The files of a saved model that hold its weights: what identifies it without reading them."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")
    )
