"""What ranks send each other is data, never a pickle that runs: a peer that speaks the protocol but
sends a pickle (one that took over a connection: gloo's peer addresses sit in the rendezvous store)
is refused on the receiving rank, and what qgtrain sends arrives exactly. Real gloo groups of real
processes (tests/ranks.py)."""

from __future__ import annotations

import io
import os
import pickle
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.ranks import run_ranks


class Planted:
    """Unpickling this makes the folder `marker`: code run by whoever reads it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return os.mkdir, (self.marker,)


def payload(kind: str, marker: str) -> bytes:
    """What a hostile peer sends: a plain pickle (what torch's object collectives read), or
    torch.save bytes shaped as qgtrain's own frame."""
    if kind == "pickle":
        return pickle.dumps(Planted(marker))
    buffer = io.BytesIO()
    torch.save({"ok": Planted(marker)}, buffer)
    return buffer.getvalue()


def _bytes(data: bytes, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.uint8)
    out[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    return out


def hostile_rank_0(kind: str, marker: str) -> list[str]:
    """Rank 0 plays the peer that took over: it speaks the length-then-bytes protocol with a
    planted payload; rank 1 receives through qgtrain: a decision (broadcast), an agreement on
    failures (all-gather) and a dispatched batch (scatter), and reports what each call did."""
    import torch.distributed as dist

    from qgtrain.data.stream.dispatch import DispatchedBatches
    from qgtrain.foundation.errors import QgtrainError
    from qgtrain.runtime import distributed
    from qgtrain.runtime.rendezvous import from_environ

    planted = payload(kind, marker)
    seen = []
    with distributed.process_group(from_environ(os.environ), torch.device("cpu"), 60, 60):
        if dist.get_rank() == 0:
            _send_as_rank_0(planted)
            return seen
        position = SimpleNamespace(epoch=0, samples_in_epoch=0)
        dispatched = DispatchedBatches(None, 2, 0, "train", dist.group.WORLD)
        for call in (
            lambda: distributed.broadcast_from_main(None),
            lambda: distributed.fail_together(None, "check"),
            lambda: dispatched.step(position, 1),
        ):
            try:
                seen.append(f"returned {call()!r}")
            except QgtrainError as exc:
                seen.append(f"{type(exc).__name__}: {exc}")
    return seen


def _send_as_rank_0(planted: bytes) -> None:
    """The broadcast, all-gather and scatter of runtime/objects.py, each carrying `planted`."""
    import torch.distributed as dist

    size = torch.tensor([len(planted)], dtype=torch.int64)
    dist.broadcast(size, src=0)
    dist.broadcast(_bytes(planted, len(planted)), src=0)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(sizes, size)
    longest = int(max(sizes).item())
    dist.all_gather(
        [torch.zeros(longest, dtype=torch.uint8) for _ in range(2)], _bytes(planted, longest)
    )
    dist.broadcast(torch.tensor([0, len(planted)], dtype=torch.int64), src=0)
    junk = torch.zeros(len(planted), dtype=torch.uint8)
    dist.scatter(junk, [junk, _bytes(planted, len(planted))], src=0)


@pytest.mark.parametrize("kind", ["pickle", "torch.save"])
def test_a_pickle_from_a_peer_is_refused_and_never_runs(tmp_path, kind):
    """Fails on 1444207: broadcast_from_main was broadcast_object_list, and fail_together
    all_gather_object: rank 1 unpickled the plain pickle and made the marker folder (the second
    unpickling then failed on the folder the first made)."""
    marker = tmp_path / "planted-code-ran"
    _, seen = run_ranks(2, hostile_rank_0, kind, str(marker), timeout=60)
    assert not marker.exists(), "a value from a peer ran as code"
    assert len(seen) == 3, seen
    for said, where in zip(seen, ["rank 0's decision", "rank 0's check", "rank 0's batches"]):
        assert said.startswith(f"QgtrainError: {where} is not data a qgtrain rank sends: "), said
        assert "HINT: another process on the network took over a connection" in said, said


VALUES: dict[str, Any] = {
    "tensors": {
        "ids": torch.arange(12, dtype=torch.int64).reshape(3, 4),
        "half": torch.randn(5, generator=torch.Generator().manual_seed(0)).bfloat16(),
        "empty": torch.zeros(0, 7),
        "mask": torch.tensor([True, False]),
    },
    "containers": (
        [1, 2.5, None, "s", b"\x00\xff", (3, 4)],
        OrderedDict(a=1),
        {("a", "b"): 1.0},
        {1, 2},
        torch.Size([2, 3]),
        torch.float16,
    ),
    "nothing": None,
}


def round_trips() -> dict[str, Any]:
    """Each collective with values of every kind qgtrain sends, a different size on each rank."""
    import torch.distributed as dist

    from qgtrain.runtime import distributed, objects
    from qgtrain.runtime.rendezvous import from_environ

    with distributed.process_group(from_environ(os.environ), torch.device("cpu"), 60, 60):
        rank, world = dist.get_rank(), dist.get_world_size()
        mine = {"rank": rank, "pad": "x" * (1000 * rank), **VALUES}
        return {
            "broadcast": objects.broadcast(VALUES if rank == 0 else None),
            "scatter": objects.scatter(
                [{"to": r, "pad": b"y" * (500 * r), **VALUES} for r in range(world)]
                if rank == 0
                else None
            ),
            "all_gather": objects.all_gather(mine),
            "gather": distributed.gather_to_main(mine),
        }


def same(a: Any, b: Any) -> bool:
    """Equal, bit for bit for tensors, and of the same types all the way down."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_values_arrive_exactly_with_their_types():
    results = run_ranks(3, round_trips, timeout=60)
    for rank, got in enumerate(results):
        assert same(got["broadcast"], VALUES), rank
        expected_own = {"to": rank, "pad": b"y" * (500 * rank), **VALUES}
        assert same(got["scatter"], expected_own), rank
        everyone = [{"rank": r, "pad": "x" * (1000 * r), **VALUES} for r in range(3)]
        assert same(got["all_gather"], everyone), rank
        assert got["gather"] is None if rank else same(got["gather"], everyone), rank


def refuses_to_send() -> list[str]:
    """Values that could only travel pickled: rank 0 (or rank 1) holds one, and every rank stops
    with the same error instead of a rank refusing what another sent on (or waiting for it)."""
    import torch.distributed as dist

    from qgtrain.foundation.errors import QgtrainError
    from qgtrain.runtime import distributed, objects
    from qgtrain.runtime.rendezvous import from_environ

    seen = []
    with distributed.process_group(from_environ(os.environ), torch.device("cpu"), 60, 60):
        rank = dist.get_rank()
        for call in (
            lambda: distributed.broadcast_from_main(Planted("/nonexistent") if rank == 0 else 1),
            lambda: objects.scatter(
                [{"ids": torch.ones(2)}, {"ids": np.ones(2)}] if rank == 0 else None, what="batch"
            ),
            lambda: objects.all_gather(np.int64(3) if rank == 1 else 3),
            lambda: distributed.gather_to_main({"path": os.getcwd()} if rank else {1: object()}),
            lambda: objects.broadcast("after them, the group still works"),
        ):
            try:
                seen.append(f"returned {call()!r}")
            except QgtrainError as exc:
                seen.append(f"{type(exc).__name__}: {str(exc).split(' HINT')[0]}")
    return seen


def test_a_value_that_is_not_data_stops_every_rank_alike():
    first, second = run_ranks(2, refuses_to_send, timeout=60)
    refused = "QgtrainError: a value sent between ranks must be tensors, numbers, strings, bytes"
    assert first[0] == second[0] and first[0].startswith(refused), first
    assert "value is a tests.test_trust_ranks.Planted" in first[0]
    assert first[1] == second[1] and "value['ids'] is a numpy.ndarray" in first[1], first
    assert first[2] == second[2] and "value is a numpy.int64" in first[2], first
    assert first[3].startswith(refused) and "value[1] is a builtins.object" in first[3], first
    assert second[3] == "returned None", second
    assert first[4] == second[4] == "returned 'after them, the group still works'"
