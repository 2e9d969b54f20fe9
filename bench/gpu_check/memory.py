"""What a rank should hold after an optimizer step, from the parameter count alone, to hold the
measured figure against (fp32 weights, as qgtrain keeps them in every precision).

ddp: every rank holds the full weights, their gradients and AdamW's two moments: 4 x 4 bytes a
parameter. fsdp over N ranks: 1/N of each of those, and during forward and backward one unit's
weights gathered (FSDP2 frees them after the unit runs:
torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py reshard), in the precision FSDP computes in
(bf16: 2 bytes a parameter).
"""

from __future__ import annotations

from dataclasses import dataclass

FP32 = 4
STATE_COPIES = 4  # weights, gradients, AdamW exp_avg and exp_avg_sq


@dataclass(frozen=True)
class Expected:
    low_bytes: float  # below this, something is missing (state not allocated, or held elsewhere)
    high_bytes: (
        float  # above this, something is held that should not be (unsharded gradients, a copy)
    )

    def holds(self, measured: float) -> bool:
        return self.low_bytes <= measured <= self.high_bytes

    def describe(self, measured: float) -> str:
        low, high = self.low_bytes / 1e9, self.high_bytes / 1e9
        return f"{measured / 1e9:.3f} GB against {low:.3f}..{high:.3f} GB"


def ddp(params: int, slack_bytes: float = 8 * 2**20) -> Expected:
    """Full state on every rank; the slack covers the optimizer's step counters and allocator
    rounding."""
    full = STATE_COPIES * FP32 * params
    return Expected(0.95 * full, 1.10 * full + slack_bytes)


def fsdp(
    params: int,
    world: int,
    largest_unit: int,
    gathered_bytes_per_param: int,
    slack_bytes: float = 8 * 2**20,
) -> Expected:
    """About 1/world of the full state, plus at most one unit's gathered weights (shards round up to
    whole rows on each rank, hence the margin)."""
    if world < 1:
        raise ValueError(f"world size {world}: at least one rank")
    share = STATE_COPIES * FP32 * params / world
    return Expected(
        0.90 * share, 1.10 * share + largest_unit * gathered_bytes_per_param + slack_bytes
    )
