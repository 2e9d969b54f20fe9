"""Work done once for the whole job (tokenizing data, an export), its result passed to every rank
through the rendezvous store rather than a collective, so a wait of hours is not cut off by the
collective timeout. What crosses is JSON (wire.py): the store is reachable from the network and
its keys are predictable.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist

from ..foundation.errors import QgtrainError
from . import wire

_calls = itertools.count()


def main_works_long(
    work: Callable[[], Any],
    what: str,
    timeout: tuple[str, float],
    visible: Callable[[Any], bool] | None = None,
) -> Any:
    """Rank 0 runs `work` and every rank gets its result, a JSON value (a tuple arrives as a list,
    on rank 0 too), however long it takes up to `timeout` (what sets the limit, and seconds).
    Waiting ranks poll the rendezvous store and say what they wait for; if rank 0 dies, the store
    it hosts goes and they fail at once. A QgtrainError raised by the work is raised on every rank
    as its qgtrain type. With `visible`, a rank on a node that cannot see the result (a node-local
    folder) has the work done once for its node, by the first of its ranks to ask."""
    if dist.get_world_size() == 1:
        return wire.decode(wire.result(work()), "the result")
    store, rank = dist.distributed_c10d._get_default_store(), dist.get_rank()
    key = f"qgtrain/once/{next(_calls)}"
    if rank == 0:
        _publish(store, key, work)
    value = _collect(store, key, f"rank 0, which {what}", timeout)
    if visible is not None and not visible(value):
        host = socket.gethostname()
        if store.add(f"{key}/{host}/asked", 1) == 1:
            _publish(store, f"{key}/{host}", work)
        value = _collect(store, f"{key}/{host}", f"another rank on {host}, which {what}", timeout)
    store.set(f"{key}/done/{rank}", "1")
    _wait_keys(
        store,
        [f"{key}/done/{r}" for r in range(dist.get_world_size())],
        f"the ranks of other nodes, where one {what}",
        timeout,
    )
    return value


def _publish(store: Any, key: str, work: Callable[[], Any]) -> None:
    try:
        text = wire.result(work())
    except QgtrainError as exc:
        text = wire.error(exc)
    store.set(key, text)


def _collect(store: Any, key: str, waiting_for: str, timeout: tuple[str, float]) -> Any:
    _wait_keys(store, [key], waiting_for, timeout)
    return wire.decode(store.get(key), f"the rendezvous store's key {key}")


def _wait_keys(store: Any, keys: list[str], waiting_for: str, timeout: tuple[str, float]) -> None:
    """Poll, first every few milliseconds: most waits are short (rank 0 finds the data already
    prepared), and a fixed pause of the longest interval cost every start about that much on every
    rank (bench.train_speed's start breakdown)."""
    start, said = time.monotonic(), 5.0  # a wait shorter than said goes unmentioned
    for pause in pauses(0.002, 0.2):
        if store.check(keys):
            return
        waited = time.monotonic() - start
        if waited > timeout[1]:
            raise QgtrainError(
                f"waited {waited:.0f} s for {waiting_for}, longer than {timeout[0]} "
                f"({timeout[1]:.0f} s). HINT: rank 0's log says whether it is still "
                "at work; if it is, allow more time or do the work before the job"
            )
        if waited >= said:
            logging.getLogger("qgtrain").info("waiting for %s (%.0f s so far)", waiting_for, waited)
            said = waited + 60
        time.sleep(pause)


def pauses(first_s: float, longest_s: float) -> Iterator[float]:
    """Sleeps between looks that grow by half each time: a wait that ends soon is seen at once, and
    a long one costs few looks."""
    pause = first_s
    while True:
        yield pause
        pause = min(pause * 1.5, longest_s)
