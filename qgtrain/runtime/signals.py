"""Stop requests from signals: the handler only sets a flag; the training loop decides what to do.

Saving or requeueing inside a handler can deadlock (a collective half-way through, a lock held by
the interrupted frame), so the trainer reads `requested` at a step boundary and agrees on it with
every rank.
"""

from __future__ import annotations

import signal
from collections.abc import Iterable
from types import FrameType
from typing import Any


class StopFlag:
    """Context manager: installs flag-setting handlers, restores the previous handlers on exit."""

    def __init__(self, signal_names: Iterable[str]) -> None:
        self.signals = [
            getattr(signal, "SIG" + name.removeprefix("SIG"))
            for name in dict.fromkeys(signal_names)
        ]
        self.received: list[str] = []
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        return bool(self.received)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if name not in self.received:  # Slurm may send one twice (a requeue's SIGTERM)
            self.received.append(name)

    def __enter__(self) -> "StopFlag":
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
