"""The model section: the built-in transformer's shape, a pretrained folder, or the user's
factory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..foundation.errors import ConfigError
from .fields import Problem, factory_problem, setting

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass(frozen=True)
class ModelConfig:
    arch: str = setting(
        "gpt2", "transformers model_type built from a config with random init (gpt2, llama, ...)"
    )
    pretrained: str | None = setting(
        None, "folder with a saved model (config.json + weights): fine-tune it, offline"
    )
    factory: str | None = setting(
        None,
        "'package.module:function' called with (vocab_size, seq_len), returning a "
        "torch.nn.Module that maps input_ids to logits",
    )
    layers: int = setting(4, "transformer blocks", min=1)
    heads: int = setting(4, "attention heads per block", min=1)
    hidden: int = setting(128, "width of the residual stream", min=8)
    dropout: float = setting(0.0, "dropout probability in every block", min=0.0, max=0.9)
    compile: Literal["auto", True, False] = setting(
        "auto",
        "torch.compile the model (each repeated block where it has them); auto: on CUDA, "
        "falling back to eager with a warning if it fails; true: anywhere, failing loudly",
    )
    adapter: Literal["none", "lora"] = setting(
        "none",
        "none: train every weight; lora: freeze the model and train LoRA adapters (peft); "
        "checkpoints then hold the adapters only",
    )
    lora_rank: int = setting(8, "rank of each LoRA adapter", min=1)
    lora_alpha: float = setting(
        16.0, "LoRA scaling: the update is multiplied by lora_alpha / lora_rank", min=0.0
    )
    lora_dropout: float = setting(0.0, "dropout on the LoRA path's input", min=0.0, max=0.9)
    lora_targets: tuple[str, ...] = setting(
        (),
        "names of the modules LoRA adapts, e.g. [q_proj, v_proj] ([] = peft's default for the "
        "architecture)",
    )


def model_rules(cfg: RunConfig) -> Problem:
    if cfg.model.pretrained and cfg.model.factory:
        return "model.factory", "set either model.pretrained or model.factory, not both"
    if not cfg.model.pretrained and not cfg.model.factory and cfg.model.hidden % cfg.model.heads:
        return "model.hidden", (
            f"{cfg.model.hidden} is not divisible by model.heads={cfg.model.heads}"
        )
    if cfg.model.adapter == "lora" and cfg.model.lora_alpha <= 0:
        return "model.lora_alpha", (
            f"{cfg.model.lora_alpha} must be above 0 (e.g. 2 x model.lora_rank)"
        )
    return factory_problem("model.factory", cfg.model.factory)


def with_pretrained_tokenizer(cfg: RunConfig) -> RunConfig:
    """model.pretrained brings its own tokenizer unless data.tokenizer names one: fine-tuning on a
    different tokenization would silently feed the model the wrong ids. Chat data needs the
    folder's tokenizer for its chat template, so a folder without one is refused here, before any
    data is read. Used by `train` and `data prepare` alike: both tokenize the same way."""
    pretrained = cfg.model.pretrained
    if not pretrained or cfg.data.tokenizer != "byte":
        return cfg
    if Path(pretrained, "tokenizer.json").is_file():
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=pretrained))
    if cfg.data.format == "chat":
        raise ConfigError(
            f"model.pretrained: {pretrained} has no tokenizer (tokenizer.json), and data.format: "
            "chat renders conversations with a tokenizer's chat template. HINT: set "
            "data.tokenizer to the model's tokenizer folder"
        )
    return cfg
