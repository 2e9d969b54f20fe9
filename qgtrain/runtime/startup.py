"""Where the time before the first step goes: process start to imports, process group, run
directory, task, wrapping, restore and the first step, each measured once and reported with the
first step.

A requeued job pays this on every allocation, so it is worth seeing; the first metrics record
carries it as `startup_s` and the log says it in one line.
"""

from __future__ import annotations

import os
import time


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), None where that cannot be read."""
    try:
        with open("/proc/self/stat") as stat:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            up_s = float(uptime.read().split()[0])
        return up_s - started_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class Timeline:
    """Named intervals between marks, in order; the first interval ends at the first mark."""

    def __init__(self) -> None:
        age = process_age_s()
        self._last = time.monotonic()
        self.intervals: dict[str, float] = {"imports": age} if age is not None else {}

    def mark(self, name: str) -> None:
        now = time.monotonic()
        self.intervals[name] = self.intervals.get(name, 0.0) + now - self._last
        self._last = now

    def describe(self) -> str:
        total = sum(self.intervals.values())
        return f"{total:.2f} s from process start to the end of the first step: " + ", ".join(
            f"{name} {seconds:.2f} s" for name, seconds in self.intervals.items()
        )
