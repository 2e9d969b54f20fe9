"""Files from one rank to another, point to point on a gloo group, a window at a time so neither
side holds more than one window of a checkpoint part in memory: its length first (int64), then its
bytes (uint8). A length of 0 sends nothing more.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any, BinaryIO

import torch
import torch.distributed as dist

WINDOW = 64 << 20


def exchange(sent: Path | None, to: int, source: int, received: Path, group: Any) -> bool:
    """Send the file `sent` (None: nothing) to rank `to` while writing what rank `source` sends
    into `received` (every rank at once, round a ring). Returns whether a file arrived and was
    written whole."""
    size = sent.stat().st_size if sent is not None else 0
    incoming = torch.zeros(1, dtype=torch.int64)
    _both(torch.tensor([size], dtype=torch.int64), to, incoming, source, group)
    total = int(incoming.item())
    with ExitStack() as files:
        out = files.enter_context(open(sent, "rb")) if sent is not None else None
        into = _opened(received, files) if total else None
        kept = into is not None
        for offset in range(0, max(size, total), WINDOW):
            window = _window(out, min(WINDOW, max(size - offset, 0)))
            arriving = torch.empty(min(WINDOW, max(total - offset, 0)), dtype=torch.uint8)
            _both(window, to, arriving, source, group)
            if kept and into is not None and arriving.numel():
                try:
                    into.write(arriving.numpy().data)
                except OSError:  # a full disk: the rest is received, not kept, as the sender waits
                    kept = False
    return kept


def send(sent: Path, to: int, group: Any) -> None:
    """The file `sent` to rank `to`, which calls receive."""
    size = sent.stat().st_size
    dist.send(torch.tensor([size], dtype=torch.int64), to, group)
    with open(sent, "rb") as out:
        for offset in range(0, size, WINDOW):
            dist.send(_window(out, min(WINDOW, size - offset)), to, group)


def receive(sender: int, received: Path, group: Any) -> None:
    """What rank `sender` sends, into the file `received`."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, sender, group)
    total = int(size.item())
    with open(received, "wb") as into:
        for offset in range(0, total, WINDOW):
            arriving = torch.empty(min(WINDOW, total - offset), dtype=torch.uint8)
            dist.recv(arriving, sender, group)
            into.write(arriving.numpy().data)


def _opened(path: Path, files: ExitStack) -> BinaryIO | None:
    """`path` to write into, or None where it cannot be made: the bytes are still received, as
    the sender waits, and not kept."""
    try:
        return files.enter_context(open(path, "wb"))
    except OSError:
        return None


def _both(sent: torch.Tensor, to: int, into: torch.Tensor, source: int, group: Any) -> None:
    works = [dist.isend(sent, to, group)] if sent.numel() else []
    works += [dist.irecv(into, source, group)] if into.numel() else []
    for work in works:
        if work is not None:
            work.wait()


def _window(out: BinaryIO | None, length: int) -> torch.Tensor:
    if out is None or length <= 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(out.read(length)), dtype=torch.uint8)
