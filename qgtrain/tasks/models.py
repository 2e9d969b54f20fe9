"""Models by name: a transformers causal LM built from a config, a local pretrained folder, or a
user factory.

Whatever the source, a model maps input_ids (batch, seq) to logits (batch, seq, vocab) and the loss
is computed here, so user factories need no Hugging Face conventions. A model built from a config
is built the fast way its shape allows (lm_shape.py), as its run's model facts say.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..foundation.errors import ConfigError, TaskError
from ..foundation.factory import load_factory
from . import lm_shape
from .lm_shape import LMShape
from .pretrained import load_pretrained

_DROPOUT_FIELDS = (
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
    "attention_dropout",
    "hidden_dropout",
    "hidden_dropout_prob",
    "attention_probs_dropout_prob",
    "dropout",
)


def build_model(
    cfg: ModelConfig,
    vocab_size: int,
    seq_len: int,
    eos_id: int | None,
    shape: LMShape = lm_shape.NEW,
) -> nn.Module:
    """Build the configured model on the CPU, in fp32, with weights from the current torch RNG:
    drawn on the CPU whatever device trains it, so a seed gives the same weights on any device.
    `shape` says how a model built from a config is built (a resumed run's: lm_shape.from_facts);
    a pretrained folder and a factory's model are built as they are."""
    if cfg.factory:
        model = load_factory(cfg.factory, "model.factory")(vocab_size=vocab_size, seq_len=seq_len)
        if not isinstance(model, nn.Module):
            raise TaskError(
                f"model.factory: {cfg.factory} returned {type(model).__name__}, not a "
                "torch.nn.Module"
            )
        return model
    import transformers

    if cfg.pretrained:
        return load_pretrained(Path(cfg.pretrained))
    try:
        config = transformers.AutoConfig.for_model(
            cfg.arch,
            vocab_size=shape.rows(vocab_size),
            hidden_size=cfg.hidden,
            num_hidden_layers=cfg.layers,
            num_attention_heads=cfg.heads,
            max_position_embeddings=seq_len,
            bos_token_id=eos_id,
            eos_token_id=eos_id,
            pad_token_id=None,
        )
    except ValueError:
        raise ConfigError(
            f"model.arch: {cfg.arch!r} is not a transformers model type (e.g. gpt2, llama, "
            "mistral, qwen2)"
        ) from None
    for name in _DROPOUT_FIELDS:
        if isinstance(getattr(config, name, None), float):
            setattr(config, name, cfg.dropout)
    try:
        return lm_shape.built(config, shape, vocab_size)
    except ValueError as exc:
        raise ConfigError(
            f"model.arch: {cfg.arch!r} has no causal-LM head in transformers ({exc})"
        ) from None


def lm_loss(
    model: nn.Module,
    tokens: torch.Tensor | Mapping[str, torch.Tensor],
    default_cache: bool = False,
) -> torch.Tensor:
    """Mean next-token cross-entropy over a batch of token windows, or over the counted tokens of a
    batch of chat rows ({input_ids, labels, position_ids(, attention_mask)}, labels -100 where the
    loss does not count): a mean per micro-batch, as for windows, however many tokens it counts.

    The labels are shifted, not the logits: slicing the logits' last position off makes a flattened
    copy of them, the largest activation of a language model, before the fp32 copy the loss needs.

    A transformers model is told use_cache=False. Its default builds a key/value cache in every
    forward: each layer's keys and values copied into it (torch.cat), held until the forward
    returns, at its peak of activation memory; and the cache's update inside a compiled block
    guards on the block's layer index, so dynamo compiles each block on its own up to its recompile
    limit (8; the rest run eager), or under activation checkpointing gives up on the block. The
    copies are what attention then reads, which moves the last bits of its gradients where dropout
    is on, so a run begun with the default keeps it (`default_cache`, from its model facts:
    lm_shape.py). Chat rows never had it: without a cache a transformers model builds its causal
    mask per sample from position ids that reset (masking_utils.find_packed_sequence_indices); with
    one it ignores them."""
    no_cache = {"use_cache": False} if _takes_use_cache(model) else {}
    if isinstance(tokens, Mapping):
        inputs = {k: v for k, v in tokens.items() if k != "labels"}
        out, targets = model(**inputs, **no_cache), tokens["labels"]
    else:
        out, targets = model(input_ids=tokens, **({} if default_cache else no_cache)), tokens
    logits = out.logits if hasattr(out, "logits") else out
    labels = F.pad(targets[:, 1:], (0, 1), value=-100)  # the last position predicts nothing
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def _takes_use_cache(model: nn.Module) -> bool:
    """Whether the forward takes use_cache: a transformers model's, under DDP or peft too. A model
    of a factory's may hold a `config` and still take no such argument."""
    inner = getattr(model, "module", model)  # DDP's
    base = getattr(inner, "get_base_model", None)  # a PeftModel's
    forward = type(base() if callable(base) else inner).forward
    return _takes("use_cache", forward)


@functools.cache
def _takes(name: str, forward: Callable[..., Any]) -> bool:
    return name in inspect.signature(forward).parameters
