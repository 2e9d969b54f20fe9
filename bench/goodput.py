"""Expected goodput at scale from qgtrain's own measured costs: what a failure every few hours
costs a 1,024- and a 16,384-GPU job, with the checkpoint interval that maximises goodput.

A model, not a measurement. Failures arrive at random (exponential) with the job's mean time between
failures M = (a GPU's MTBF) / GPUs; each costs the time to train again (a retry in the allocation,
or a requeue and its wait in the queue) plus the work since the last checkpoint it can resume from
(half an interval on average). A save stalls the loop for C. To first order (Young 1974, Daly
2006), the share of time wasted is C / t + (R + t / 2) / M for a checkpoint every t seconds, least
at t = sqrt(2 C M). With a node-local tier besides the shared one, a failure resumes from the local
tier (its interval's half lost) and both tiers' stalls are paid.

The costs default to this project's measurements (docs/performance.md, docs/slurm.md): a 302.6M
model under fsdp saved asynchronously stalls 0.907 s to the shared tier and 0.707 s to the local
one (bench.checkpoint_tiers); a rank killed on the test cluster trains again in its allocation
after 11 s, on a spare node too (tests/test_slurm_recovery.py). A requeue's wait in the queue is
the cluster's, not ours: --queue-s sets it (default 10 minutes). The failure rate defaults to Llama
3's: 419 interruptions in 54 days on 16,384 GPUs, a GPU's MTBF of about 50,700 hours (arXiv
2407.21783); --mtbf-gpu-h sets others.

Usage: python -m bench.goodput [--shared-s 0.907] [--local-s 0.707] [--retry-s 11]
[--queue-s 600] [--mtbf-gpu-h 50700]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

LLAMA3_MTBF_GPU_H = 54 * 24 * 16384 / 419  # 54 days, 16,384 GPUs, 419 interruptions


@dataclass(frozen=True)
class Costs:
    """Seconds: a save's stall to each tier, training again in the allocation, a requeue's
    wait."""

    shared_s: float
    local_s: float
    retry_s: float
    queue_s: float


def wasted(interval_s: float, save_s: float, restart_s: float, mtbf_s: float) -> float:
    """The share of a job's time lost to saves and failures, first order: saving every
    `interval_s`, each failure costing `restart_s` and half an interval."""
    return save_s / interval_s + (restart_s + interval_s / 2) / mtbf_s


def best_interval(save_s: float, mtbf_s: float) -> float:
    """Young/Daly: the interval that minimises `wasted`."""
    return math.sqrt(2 * save_s * mtbf_s)


def one_tier(costs: Costs, mtbf_s: float, restart_s: float) -> tuple[float, float]:
    """Goodput and interval with the shared tier alone, saved at its best interval."""
    interval = best_interval(costs.shared_s, mtbf_s)
    return 1 - wasted(interval, costs.shared_s, restart_s, mtbf_s), interval


def two_tiers(costs: Costs, mtbf_s: float, restart_s: float) -> tuple[float, float]:
    """Goodput and the local tier's interval, a failure resuming from the local tier (a neighbour
    keeps each node's replica); the shared tier saved hourly, its stall the only cost it adds."""
    interval = best_interval(costs.local_s, mtbf_s)
    shared = costs.shared_s / 3600
    return 1 - wasted(interval, costs.local_s, restart_s, mtbf_s) - shared, interval


def table(costs: Costs, mtbf_gpu_h: float) -> list[str]:
    ways = ("shared tier, requeue", "shared tier, spare node", "both tiers, spare node")
    rows = [f"| GPUs | job MTBF | {' | '.join(ways)} |", "|---|---|---|---|---|"]
    for gpus in (1024, 16384):
        mtbf_s = mtbf_gpu_h * 3600 / gpus
        cells = [
            one_tier(costs, mtbf_s, costs.retry_s + costs.queue_s),
            one_tier(costs, mtbf_s, costs.retry_s),
            two_tiers(costs, mtbf_s, costs.retry_s),
        ]
        shown = [f"{good:.1%} (every {interval / 60:.1f} min)" for good, interval in cells]
        rows.append(f"| {gpus:,} | {mtbf_s / 3600:.1f} h | " + " | ".join(shown) + " |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description="expected goodput at scale, by a model")
    parser.add_argument("--shared-s", type=float, default=0.907)
    parser.add_argument("--local-s", type=float, default=0.707)
    parser.add_argument("--retry-s", type=float, default=11.0)
    parser.add_argument("--queue-s", type=float, default=600.0)
    parser.add_argument("--mtbf-gpu-h", type=float, default=LLAMA3_MTBF_GPU_H)
    args = parser.parse_args()
    costs = Costs(args.shared_s, args.local_s, args.retry_s, args.queue_s)
    print(f"a GPU's MTBF {args.mtbf_gpu_h:,.0f} h; {costs}")
    for line in table(costs, args.mtbf_gpu_h):
        print(line)
    for scale in (0.5, 2.0):
        print(f"\na GPU's MTBF x{scale}:")
        for line in table(costs, args.mtbf_gpu_h * scale)[2:]:
            print(line)


if __name__ == "__main__":
    main()
