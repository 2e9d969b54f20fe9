"""LoRA adapters on the task's model: peft's layers put into the model itself, the base frozen.

peft's `inject_adapter_in_model` is used, not `get_peft_model`: it adapts the model object in place,
so the task's loss, the model's `_no_split_modules` (FSDP units, activation checkpointing), its
`config` (hf_config.json, export) and every name but the adapters' stay as they are without an
adapter; a PeftModel would put `base_model.model.` before every name and hide the class the rest
looks for. The model records what its frozen base is (weights.ADAPTER_ATTRIBUTE), so a checkpoint
holds only the adapters and can refuse to be resumed onto another base.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from torch import nn

from ..config import ModelConfig, RunConfig
from ..foundation.errors import ConfigError
from ..foundation.task import BUILTIN_LM
from ..state.weights import ADAPTER_ATTRIBUTE
from ..tasks.pretrained import weight_files

ADAPTER_NAME = "default"
_LINEAR_LIKE = ("Linear", "Conv1D", "Conv1d", "Embedding")


def apply_adapter(model: nn.Module, cfg: RunConfig) -> nn.Module:
    """The model with LoRA adapters on model.lora_targets (model.adapter: lora), its base frozen;
    as it is for model.adapter: none. Called on every rank before the parallel wrap, with the same
    seed."""
    if cfg.model.adapter == "none":
        return model
    from peft import inject_adapter_in_model

    base, targets = base_identity(model, cfg), targets_for(model, cfg.model)
    model.requires_grad_(False)
    inject_adapter_in_model(lora_config(cfg.model, targets), model, ADAPTER_NAME)
    model.train(
        model.training
    )  # the new layers' dropout in the model's mode, as a resumed start has them
    for name, param in model.named_parameters():
        param.requires_grad_(".lora_" in name)
    lora = {"rank": cfg.model.lora_rank, "alpha": cfg.model.lora_alpha, "targets": targets}
    setattr(model, ADAPTER_ATTRIBUTE, {"base": base, "lora": lora})
    return model


def lora_config(model: ModelConfig, targets: list[str], base_path: str | None = None) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=model.lora_rank,
        lora_alpha=model.lora_alpha,
        lora_dropout=model.lora_dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",
        base_model_name_or_path=base_path,
    )


def targets_for(model: nn.Module, settings: ModelConfig) -> list[str]:
    """model.lora_targets, each checked to name a module of the model; or peft's default for its
    architecture."""
    names = [
        name
        for name, module in model.named_modules()
        if name and type(module).__name__ in _LINEAR_LIKE
    ]
    if not settings.lora_targets:
        from peft.utils.constants import (
            TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULTS,
        )

        model_type = getattr(getattr(model, "config", None), "model_type", None)
        if model_type not in DEFAULTS:
            raise ConfigError(
                f"model.lora_targets: peft has no default modules for "
                f"{model_type or type(model).__name__}; name the modules to adapt, "
                f"e.g. model.lora_targets: [{', '.join(leaf_names(names)[:2])}]"
            )
        return list(DEFAULTS[model_type])
    unknown = [
        t for t in settings.lora_targets if not any(n == t or n.endswith("." + t) for n in names)
    ]
    if unknown:
        shown = leaf_names(names)
        raise ConfigError(
            f"model.lora_targets: {', '.join(unknown)} name(s) no module of "
            f"{type(model).__name__}; its linear modules are {', '.join(shown[:20])}"
            + (f" and {len(shown) - 20} more" if len(shown) > 20 else "")
        )
    return list(settings.lora_targets)


def leaf_names(names: list[str]) -> list[str]:
    """The last part of each module name, once each: q_proj, not model.layers.0.self_attn.q_proj."""
    return sorted({name.rpartition(".")[2] for name in names})


def base_identity(model: nn.Module, cfg: RunConfig) -> dict[str, Any]:
    """What the frozen base is. A pretrained folder: its resolved path and a hash of its weight
    files' names and sizes (read without opening them). A model built here: a hash of what builds
    it (the architecture or factory, every tensor's name and shape) and the seed that drew its
    weights."""
    if cfg.model.pretrained:
        folder = Path(cfg.model.pretrained).resolve()
        files = [(name, (folder / name).stat().st_size) for name in weight_files(folder)]
        return {"pretrained": str(folder), "weights": _digest(files)}
    shapes = [(name, list(t.shape)) for name, t in model.state_dict().items()]
    what = (
        (cfg.model.factory or cfg.model.arch)
        if cfg.task.factory == BUILTIN_LM
        else cfg.task.factory
    )
    return {"built": what, "shapes": _digest(shapes), "seed": cfg.train.seed}


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()
