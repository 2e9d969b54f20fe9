"""Shared by the benchmarks: alternate candidate and baseline in one process, report medians and
ratios."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def alternate(
    pairs: dict[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    settle: Callable[[], object] = lambda: None,
) -> dict[str, list[float]]:
    """Time each callable `repeats` times, interleaved (a, b, a, b, ...) so drift hits both alike.

    `settle` runs untimed after every call (e.g. to let background work finish before the next
    timing).
    """
    for _ in range(warmup):
        for fn in pairs.values():
            fn()
            settle()
    times: dict[str, list[float]] = {name: [] for name in pairs}
    for _ in range(repeats):
        for name, fn in pairs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
            settle()
    return times


def report(
    title: str, times: dict[str, list[float]], candidate: str, baseline: str, goal: str
) -> float:
    med = {name: statistics.median(values) for name, values in times.items()}
    ratio = med[candidate] / med[baseline]
    print(
        f"{title}: {candidate} median {med[candidate] * 1e3:.1f} ms, {baseline} median "
        f"{med[baseline] * 1e3:.1f} ms, ratio {ratio:.3f} (goal {goal}; n={len(times[candidate])})"
    )
    return ratio


def torchrun_env(rank: int, world: int, port: int) -> dict[str, str]:
    """The variables torchrun gives rank `rank` of `world` on this machine, the store on `port`."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
