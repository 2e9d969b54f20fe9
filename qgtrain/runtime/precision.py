"""Mixed precision: which dtype a run computes in, the autocast context, and a GradScaler only for
fp16.

Which precision is a plain function of the device's kind and compute capability (`choose`), so the
choice for every GPU can be checked without one. bf16 runs natively from compute capability 8.0
(A100, H100, L4, ...). Below that (V100 7.0, T4 7.5) torch only emulates it, without tensor cores,
though `torch.cuda.is_bf16_supported()` says yes by default: `auto` picks fp32 there, and an
explicit bf16 is kept but warned about. fp32 on those GPUs runs its matrix products on TF32 tensor
cores (fp32 storage and accumulation, a 10-bit mantissa for the products' inputs), as nanoGPT and
the cuDNN convolutions do by default: several times faster than plain fp32 (training/flops.py has
the peaks), and what PyTorch's own documentation recommends for training.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass

import torch

from ..foundation.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
NATIVE_BF16 = (8, 0)  # torch.cuda.is_bf16_supported(including_emulation=False): major >= 8, or ROCm

log = logging.getLogger("qgtrain")


@dataclass(frozen=True)
class PrecisionChoice:
    precision: str
    why: str
    warning: str | None = None


def choose(
    requested: str,
    device_type: str,
    capability: tuple[int, int] | None = None,
    name: str = "",
    rocm: bool = False,
) -> PrecisionChoice:
    """The precision for train.precision `requested` on a device of `device_type` ('cpu' or 'cuda')
    with compute capability `capability`; refuses what the device cannot run."""
    if device_type != "cuda":
        if requested == "fp16":
            raise ConfigError(
                "train.precision: fp16 needs a GPU (this rank runs on the CPU); use bf16 or fp32"
            )
        return (
            PrecisionChoice("fp32", "auto on the CPU")
            if requested == "auto"
            else PrecisionChoice(requested, "train.precision")
        )
    native = rocm or (capability is not None and tuple(capability) >= NATIVE_BF16)
    gpu = name or "this GPU"
    if capability is not None and not rocm:
        gpu += f" (compute capability {capability[0]}.{capability[1]})"
    if requested == "auto" and native:
        return PrecisionChoice("bf16", f"auto: {gpu} computes bf16 natively")
    if requested == "auto":
        return PrecisionChoice(
            "fp32",
            f"auto: {gpu} has no native bf16 (torch would emulate it, several times slower); "
            "train.precision: fp16 is faster there, with loss scaling",
        )
    if requested == "bf16" and not native:
        return PrecisionChoice(
            "bf16",
            "train.precision",
            warning=(
                f"train.precision: bf16 on {gpu}, which has no native bf16: torch emulates it "
                "without tensor cores, several times slower than fp16 and slower than fp32. HINT: "
                "train.precision: fp16 (with loss scaling) or fp32"
            ),
        )
    return PrecisionChoice(requested, "train.precision")


def uses_tf32(
    precision: str, device_type: str, capability: tuple[int, int] | None, rocm: bool = False
) -> bool:
    """Whether fp32 matrix products run on TF32 tensor cores: compute capability 8.0 and newer
    (NVIDIA)."""
    return (
        precision == "fp32"
        and device_type == "cuda"
        and not rocm
        and capability is not None
        and tuple(capability) >= NATIVE_BF16
    )


def resolve(precision: str, device: torch.device) -> str:
    """Turn 'auto' into a concrete choice for this rank's own GPU, log it, and warn once (this runs
    once per process) where an explicit choice costs more than the user may know."""
    capability, name = None, ""
    if device.type == "cuda":
        capability, name = (
            torch.cuda.get_device_capability(device),
            torch.cuda.get_device_name(device),
        )
    rocm = bool(torch.version.hip)
    choice = choose(precision, device.type, capability, name, rocm=rocm)
    tf32 = uses_tf32(choice.precision, device.type, capability, rocm)
    if tf32:
        # torch/__init__.py: "high" allows TF32 for matmuls
        torch.set_float32_matmul_precision("high")
    with_tf32 = " with TF32 matrix products" if tf32 else ""
    log.info("precision %s%s (%s)", choice.precision, with_tf32, choice.why)
    if choice.warning:
        log.warning("%s", choice.warning)
    return choice.precision


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Autocast for bf16/fp16; weights and optimizer state stay fp32 either way."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[precision])


def weights_cast_once(
    precision: str, device: torch.device
) -> contextlib.AbstractContextManager[object]:
    """Around a step's micro-batches: each weight cast to `precision` once per step, not once per
    micro-batch. Autocast keeps the copies it casts of leaf weights until its outermost context
    exits (torch/amp/autocast_mode.py: __exit__ clears the cache at nesting 0); this outer context,
    disabled, keeps the nesting above 0 between micro-batches and leaves backward outside autocast,
    as torch advises. The weights do not change within a step, so the copies are the ones each
    micro-batch would have made: the same results, bit for bit. (A compiled block casts inside its
    own graph: this spares the eager runs.)"""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, enabled=False)


def grad_scaler(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Loss scaling is needed for fp16's narrow exponent only; disabled, the scaler is a
    pass-through."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
