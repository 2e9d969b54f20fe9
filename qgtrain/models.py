"""Models by name: a transformers causal LM built from a config, a local pretrained folder, or a user factory.

Whatever the source, a model maps input_ids (batch, seq) to logits (batch, seq, vocab) and the loss is
computed here, so user factories need no Hugging Face conventions. `unwrap` is the one place where the
DDP (`module.`) and torch.compile (`_orig_mod.`) wrappers are removed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .errors import CheckpointError, ConfigError
from .factory import load_factory

_DROPOUT_FIELDS = ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout",
                   "hidden_dropout_prob", "attention_probs_dropout_prob", "dropout")
_WRAPPER_PREFIXES = ("module.", "_orig_mod.")


def build_model(cfg: ModelConfig, vocab_size: int, seq_len: int, eos_id: int | None) -> nn.Module:
    """Build the configured model on the CPU, in fp32, with weights from the current torch RNG."""
    if cfg.factory:
        model = load_factory(cfg.factory, "model.factory")(vocab_size=vocab_size, seq_len=seq_len)
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model.factory: {cfg.factory} returned {type(model).__name__}, not a torch.nn.Module")
        return model
    import transformers

    if cfg.pretrained:
        path = Path(cfg.pretrained)
        if not (path / "config.json").is_file():
            raise ConfigError(f"model.pretrained: {path} has no config.json; expected a folder written by "
                              "save_pretrained (e.g. by `qgtrain export`)")
        try:
            return transformers.AutoModelForCausalLM.from_pretrained(path, local_files_only=True,
                                                                     dtype=torch.float32)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"model.pretrained: cannot load {path}: {str(exc).splitlines()[0]}") from None
    try:
        config = transformers.AutoConfig.for_model(
            cfg.arch, vocab_size=vocab_size, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads, max_position_embeddings=seq_len,
            bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=None)
    except ValueError:
        raise ConfigError(f"model.arch: {cfg.arch!r} is not a transformers model type (e.g. gpt2, llama, "
                          "mistral, qwen2)") from None
    for name in _DROPOUT_FIELDS:
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, cfg.dropout)
    try:
        return transformers.AutoModelForCausalLM.from_config(config)
    except ValueError as exc:
        raise ConfigError(f"model.arch: {cfg.arch!r} has no causal-LM head in transformers ({exc})") from None


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over a batch of token windows."""
    out = model(input_ids=tokens)
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside DDP and torch.compile wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def strip_wrapper_prefixes(state: Mapping[str, Any]) -> dict[str, Any]:
    """State-dict keys without `module.`/`_orig_mod.`, for checkpoints written by wrapped models elsewhere."""
    out = {}
    for key, value in state.items():
        while key.startswith(_WRAPPER_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def load_weights(model: nn.Module, state: dict[str, Any], source: Path) -> None:
    """Load weights, or say exactly how the checkpoint's model differs from the configured one."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    extra = sorted(set(state) - set(own))
    shapes = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
              for k in own if k in state and state[k].shape != own[k].shape]
    if missing or extra or shapes:
        parts = ([f"shapes differ ({'; '.join(shapes[:3])})"] if shapes else []) + \
                ([f"missing from the checkpoint: {', '.join(missing[:5])}"] if missing else []) + \
                ([f"not in the model: {', '.join(extra[:5])}"] if extra else [])
        raise CheckpointError(f"{source} does not fit the configured model: {'; '.join(parts)}. HINT: resume "
                              "with the model settings it was trained with, or set checkpoint.resume: never")
    model.load_state_dict(state)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in unwrap(model).parameters())
