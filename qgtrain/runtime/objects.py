"""What ranks send each other that is not one tensor (a decision, a checkpoint's outcome, a batch),
as data.

torch's object collectives (broadcast_object_list, scatter_object_list, ...) pickle the value and
unpickle whatever arrives, and the addresses ranks connect to (gloo's, NCCL's) are published in the
rendezvous store, which anyone on the network can write: a process that took over a connection
would run code in every rank. Here a value is written with torch.save and read back with
weights_only=True, so what arrives is tensors, numbers, strings, bytes, None and lists, tuples,
sets and dicts of them, or a refusal. The sender checks its value first, so a value that could not
be read stops every rank with the same error instead of one rank refusing what another sent on.
Each value travels as its length (int64) and then its bytes (uint8, padded to the longest where
ranks send at once), CPU tensors on the group's gloo backend; tensors arrive on the CPU.

Every function is a collective of `group` (the default group when None); its rank 0 is the
group's.
"""

from __future__ import annotations

import io
from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..foundation.errors import QgtrainError, first_line
from . import wire

# What weights_only reads (torch/_weights_only_unpickler.py): exact types, since a subclass (a
# namedtuple, a tokenizer's BatchEncoding) pickles by its own class's name and would be refused.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, bytearray)
_TORCH_ATOMS = (torch.dtype, torch.device, torch.Size)
_TENSORS = (torch.Tensor, torch.nn.Parameter)
_SEQUENCES = (list, tuple, set)
_MAPPINGS = (dict, OrderedDict, Counter)


def broadcast(value: Any, group: dist.ProcessGroup | None = None, what: str = "value") -> Any:
    """Rank 0's `value` on every rank (rank 0 keeps its own object). `what` names it in errors."""
    main = dist.get_rank(group) == 0
    frame, refused = _frame([value]) if main else (None, None)
    size = torch.tensor([len(frame) if frame is not None else 0], dtype=torch.int64)
    dist.broadcast(size, group_src=0, group=group)
    data = _padded(frame, int(size.item())) if main else _empty(int(size.item()), what)
    dist.broadcast(data, group_src=0, group=group)
    if not main:
        return _decode(data, int(size.item()), f"rank 0's {what}")
    return _kept(value, refused)


def all_gather(
    value: Any, group: dist.ProcessGroup | None = None, what: str = "value"
) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank."""
    frame, refused, sizes = _sizes(value, group)
    longest = max(sizes)
    out = [_empty(longest, what) for _ in sizes]
    dist.all_gather(out, _padded(frame, longest), group=group)
    return _values(value, refused, out, sizes, dist.get_rank(group), what)


def gather(
    value: Any, group: dist.ProcessGroup | None = None, what: str = "value"
) -> list[Any] | None:
    """Every rank's `value`, in rank order, on rank 0; None on the others."""
    frame, refused, sizes = _sizes(value, group)
    rank, longest = dist.get_rank(group), max(sizes)
    out = [_empty(longest, what) for _ in sizes] if rank == 0 else None
    dist.gather(_padded(frame, longest), out, group_dst=0, group=group)
    if out is None:
        _kept(value, refused)
        return None
    return _values(value, refused, out, sizes, rank, what)


def scatter(
    values: Sequence[Any] | None, group: dist.ProcessGroup | None = None, what: str = "value"
) -> Any:
    """values[r] on each rank r, from rank 0 (the others pass None). Rank 0 keeps its own part
    unencoded, sparing it a copy each call (data.dispatch sends a batch a step); a part that
    cannot travel stops every rank, rank 0 too."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    frames: list[memoryview | None] = [None] * world
    refused = None
    if rank == 0:
        if values is None or len(values) != world:
            raise ValueError(f"scatter needs one value per rank ({world}) on rank 0")
        refused = _refusal(values)
        frames = [None, *(refused or _save({"ok": v}) for v in values[1:])]
    sizes = torch.tensor([len(f) if f is not None else 0 for f in frames], dtype=torch.int64)
    dist.broadcast(sizes, group_src=0, group=group)
    longest = int(sizes.max().item())
    data = _empty(longest, what)
    parts = [data, *(_padded(f, longest) for f in frames[1:])] if rank == 0 else None
    dist.scatter(data, parts, group_src=0, group=group)
    if rank != 0:
        return _decode(data, int(sizes[rank].item()), f"rank 0's {what}")
    assert values is not None
    return _kept(values[0], refused)


def _frame(values: Sequence[Any]) -> tuple[memoryview, memoryview | None]:
    """The frame of values[0], or the refusal every rank gets when any of `values` cannot travel
    (twice: the frame and the refusal)."""
    refused = _refusal(values)
    return (refused, refused) if refused is not None else (_save({"ok": values[0]}), None)


def _refusal(values: Sequence[Any]) -> memoryview | None:
    for value in values:
        if (problem := _not_data(value, "value")) is not None:
            return _save({"error": wire.error(QgtrainError(problem))})
    return None


def _sizes(
    value: Any, group: dist.ProcessGroup | None
) -> tuple[memoryview, memoryview | None, list[int]]:
    """This rank's frame, its refusal if any, and every rank's frame length (one all-gather)."""
    frame, refused = _frame([value])
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, torch.tensor([len(frame)], dtype=torch.int64), group=group)
    return frame, refused, [int(s.item()) for s in sizes]


def _values(
    value: Any,
    refused: memoryview | None,
    frames: list[torch.Tensor],
    sizes: list[int],
    rank: int,
    what: str,
) -> list[Any]:
    """The values in rank order, this rank's own kept; the lowest rank's refusal raised instead."""
    return [
        _kept(value, refused) if r == rank else _decode(data, sizes[r], f"rank {r}'s {what}")
        for r, data in enumerate(frames)
    ]


def _kept(value: Any, refused: memoryview | None) -> Any:
    """The sender's own value, or the refusal it sent the others, raised here too."""
    if refused is None:
        return value
    return _decode(torch.frombuffer(refused, dtype=torch.uint8), len(refused), "this rank's value")


def _save(frame: dict[str, Any]) -> memoryview:
    buffer = io.BytesIO()
    torch.save(frame, buffer)
    return buffer.getbuffer()


def _not_data(value: Any, where: str) -> str | None:
    """Why `value` cannot travel (naming where in it), or None: what weights_only reads back."""
    kind = type(value)
    if kind in _ATOMS or kind in _TORCH_ATOMS or kind in _TENSORS:
        return None
    if kind in _SEQUENCES:
        return next((p for i, v in enumerate(value) if (p := _not_data(v, f"{where}[{i}]"))), None)
    if kind in _MAPPINGS:
        for key, item in value.items():
            if p := _not_data(key, f"a key of {where}") or _not_data(item, f"{where}[{key!r}]"):
                return p
        return None
    return (
        f"a value sent between ranks must be tensors, numbers, strings, bytes or None, in lists, "
        f"tuples, sets and dicts: {where} is a {kind.__module__}.{kind.__qualname__}. HINT: a "
        "task's batches too (data.dispatch sends them): return dicts or tuples of tensors"
    )


def _decode(data: torch.Tensor, size: int, where: str) -> Any:
    """The value in the first `size` bytes of `data`, read as data; an error it carries raised as
    its qgtrain type (wire.py), anything that is not what a qgtrain rank sends refused."""
    try:
        frame = torch.load(
            io.BytesIO(data[:size].numpy().tobytes()), map_location="cpu", weights_only=True
        )
    except Exception as exc:  # noqa: BLE001 torch.load on network bytes raises bare Exceptions
        raise QgtrainError(
            f"{where} is not data a qgtrain rank sends: {first_line(exc)}. {_HINT}"
        ) from None
    if isinstance(frame, dict) and set(frame) == {"ok"}:
        return frame["ok"]
    if isinstance(frame, dict) and set(frame) == {"error"} and isinstance(frame["error"], str):
        return wire.decode(frame["error"], where)
    raise QgtrainError(f"{where} is not data a qgtrain rank sends. {_HINT}")


def _padded(frame: memoryview | None, size: int) -> torch.Tensor:
    """`frame` in a uint8 tensor of `size` bytes (zeros after it)."""
    if frame is not None and len(frame) == size and size:
        return torch.frombuffer(frame, dtype=torch.uint8)
    data = torch.zeros(size, dtype=torch.uint8)
    if frame is not None and len(frame):
        data[: len(frame)] = torch.frombuffer(frame, dtype=torch.uint8)
    return data


def _empty(size: int, what: str) -> torch.Tensor:
    try:
        return torch.empty(size, dtype=torch.uint8)
    except (RuntimeError, ValueError) as exc:  # a length no qgtrain rank sends
        raise QgtrainError(
            f"a {what} announced as {size} bytes, which no qgtrain rank sends: "
            f"{first_line(exc)}. {_HINT}"
        ) from None


_HINT = (
    "HINT: another process on the network took over a connection between this job's ranks "
    "(their addresses are in the rendezvous store, which anyone who reaches its port can write); "
    "qgtrain refused what it sent rather than run it. Run jobs where only their own nodes reach "
    "each other, and report it"
)
