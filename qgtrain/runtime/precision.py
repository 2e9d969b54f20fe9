"""Mixed precision: which dtype a run computes in, the autocast context, and a GradScaler only for fp16."""

from __future__ import annotations

import contextlib

import torch

from ..errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve(precision: str, device: torch.device) -> str:
    """Turn 'auto' into a concrete choice, and refuse a choice the device cannot run."""
    if precision == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32"
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError("train.precision: fp16 needs a GPU (this rank runs on the CPU); use bf16 or fp32")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"train.precision: bf16 is not supported by {torch.cuda.get_device_name(device)}; "
                          "use fp16 (with loss scaling) or fp32")
    return precision


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Autocast for bf16/fp16; weights and optimizer state stay fp32 either way."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling is needed for fp16's narrow exponent only; disabled, the scaler is a pass-through."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
