"""Bytes from one rank to another, point to point on a gloo group: a checkpoint part as it lies on
disk, checked by its checksum where it is written again. Each travels as its length (int64) and
then its bytes (uint8); a length of 0 sends nothing more.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def exchange(payload: bytes, to: int, source: int, group: dist.ProcessGroup) -> bytes:
    """Send `payload` to `to` while receiving `source`'s (every rank at once, round a ring): its
    length first, then its bytes (none when the write failed)."""
    incoming = torch.zeros(1, dtype=torch.int64)
    _both(torch.tensor([len(payload)], dtype=torch.int64), to, incoming, source, group)
    out = torch.empty(int(incoming.item()), dtype=torch.uint8)
    _both(_bytes_tensor(payload), to, out, source, group)
    return out.numpy().tobytes()


def _both(
    sent: torch.Tensor, to: int, into: torch.Tensor, source: int, group: dist.ProcessGroup
) -> None:
    works = [dist.isend(sent, to, group)] if sent.numel() else []
    works += [dist.irecv(into, source, group)] if into.numel() else []
    for work in works:
        if work is not None:
            work.wait()


def send(data: bytes, to: int, group: dist.ProcessGroup) -> None:
    """`data` to rank `to`, which calls receive."""
    dist.send(torch.tensor([len(data)], dtype=torch.int64), to, group)
    if data:
        dist.send(_bytes_tensor(data), to, group)


def receive(sender: int, group: dist.ProcessGroup) -> bytes:
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, sender, group)
    out = torch.empty(int(size.item()), dtype=torch.uint8)
    if out.numel():
        dist.recv(out, sender, group)
    return out.numpy().tobytes()


def _bytes_tensor(data: bytes) -> torch.Tensor:
    if not data:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
