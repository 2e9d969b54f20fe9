"""Model FLOPs utilisation: the achieved training FLOP/s over what the rank's GPU can do at most in
the run's precision.

The peak is dense tensor-core throughput from the vendor's data sheet, per device that torch sees
(an MI250X shows up as two devices, one per GCD, so its row is half the module). Device names are
matched whole, after the vendor's prefix, because part names nest: an L40 is not an L4, an RTX A4000
is not an A40, an H100 PCIe is not an H100 SXM. A GPU missing from the table gets no MFU rather than
a wrong one; train.peak_tflops names its peak. An fp32 run is measured against TF32 where its matrix
products use TF32 (runtime/precision.py allows it from compute capability 8.0), else plain fp32;
bf16 on a GPU without it (V100, T4) has no peak: torch emulates it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

_PREFIXES = re.compile(r"^(NVIDIA |Tesla |AMD Instinct |AMD )?(GeForce )?")
_MEMORY = r"( \d+GB)?( HBM3e?)?"
_SXM = rf"( SXM\d?)?{_MEMORY}"


@dataclass(frozen=True)
class Peak:
    """Dense TFLOP/s by precision; None where the GPU cannot compute in it natively."""

    bf16: float | None
    fp16: float
    tf32: float | None
    fp32: float


# (full-name pattern, peak), from each vendor's data sheet; the SXM part where a name has no form
# factor.
PEAKS: list[tuple[str, Peak]] = [
    (rf"H100{_SXM}", Peak(989.4, 989.4, 494.7, 66.9)),
    (rf"H100 PCIe{_MEMORY}", Peak(756.5, 756.5, 378.0, 51.2)),
    (rf"H100 NVL{_MEMORY}", Peak(835.5, 835.5, 417.5, 60.0)),
    (rf"H800{_SXM}", Peak(989.4, 989.4, 494.7, 66.9)),
    (rf"H800 PCIe{_MEMORY}", Peak(756.5, 756.5, 378.0, 51.2)),
    (rf"H200{_SXM}", Peak(989.4, 989.4, 494.7, 66.9)),
    (rf"H200 NVL{_MEMORY}", Peak(835.5, 835.5, 417.5, 60.0)),
    (rf"GH200{_MEMORY}", Peak(989.4, 989.4, 494.7, 66.9)),
    (rf"B200{_MEMORY}", Peak(2250.0, 2250.0, 1125.0, 75.0)),
    (r"A100([- ](SXM4|PCIE|\d+GB)[-\w ]*)?", Peak(312.0, 312.0, 156.0, 19.5)),
    (r"A800([- ](SXM4|PCIE|\d+GB)[-\w ]*)?", Peak(312.0, 312.0, 156.0, 19.5)),
    (r"L40S", Peak(362.1, 362.1, 183.0, 91.6)),
    (r"L40", Peak(181.0, 181.0, 90.5, 90.5)),
    (r"L4", Peak(121.0, 121.0, 60.0, 30.3)),
    (r"A40", Peak(149.7, 149.7, 74.8, 37.4)),
    (r"A10", Peak(125.0, 125.0, 62.5, 31.2)),
    (r"V100-SXM\d-\d+GB", Peak(None, 125.0, None, 15.7)),
    (r"V100-PCIE-\d+GB", Peak(None, 112.0, None, 14.0)),
    (r"T4", Peak(None, 65.0, None, 8.1)),
    (r"RTX 4090", Peak(165.2, 165.2, 82.6, 82.6)),
    (r"RTX 3090", Peak(71.0, 71.0, 35.6, 35.6)),
    (r"MI300X( OAM)?", Peak(1307.4, 1307.4, 653.7, 163.4)),
    (r"MI250X(/MI250)?", Peak(191.5, 191.5, None, 47.9)),
    (r"MI250", Peak(181.0, 181.0, None, 45.3)),
]


def peak_flops(device_name: str, precision: str) -> float | None:
    """FLOP/s at most of one device named `device_name` computing in `precision`, or None if
    unknown."""
    name = _PREFIXES.sub("", device_name.strip())
    for pattern, peak in PEAKS:
        if re.fullmatch(pattern, name):
            tflops = getattr(peak, precision) or (peak.fp32 if precision == "tf32" else None)
            return tflops * 1e12 if tflops else None
    return None


def utilisation(
    flops_per_sample: float | None,
    samples_per_s: float,
    peak_per_rank: float | None,
    world_size: int,
) -> dict[str, float]:
    """{'mfu': ...} where both the task's FLOPs per sample and the peak are known, else {}."""
    if not flops_per_sample or not peak_per_rank:
        return {}
    return {"mfu": flops_per_sample * samples_per_s / (peak_per_rank * world_size)}


def device_peak(device: torch.device, precision: str, override_tflops: float = 0.0) -> float | None:
    """The peak FLOP/s of this rank's device in `precision`: train.peak_tflops where set, else the
    table's for a GPU it knows; None on a CPU."""
    if override_tflops > 0:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    import torch

    tf32 = precision == "fp32" and torch.get_float32_matmul_precision() != "highest"
    return peak_flops(torch.cuda.get_device_name(device), "tf32" if tf32 else precision)
