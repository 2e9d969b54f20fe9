"""Preparation's worker processes: batches of work done in data.prepare_workers processes and
handed back in the order they were given.

Both the text and the chat formats read their files in one process (the order of documents decides
the cache's bytes) and give the tokenizing, the costly part, to this pool. The results come back in
submission order, so a cache is byte for byte the same whatever the number of workers, and at most
two batches per worker are in flight, so memory stays bounded whatever the corpus size. With one
worker the work runs in this process, without starting any.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from multiprocessing import get_context
from typing import Any, Generic, TypeVar

Result = TypeVar("Result")


class OrderedPool(Generic[Result]):
    """`work` (picklable: a module-level function, or a partial of one) on each batch, in `workers`
    spawned processes; submit yields the results that are done, finish the rest, each with the tag
    it was submitted with."""

    def __init__(self, work: Callable[..., Result], workers: int) -> None:
        self.work = work
        self.pool = (
            ProcessPoolExecutor(workers, mp_context=get_context("spawn")) if workers > 1 else None
        )
        self.window: deque[tuple[Any, Future[Result]]] = deque()
        self.limit = 2 * workers

    def __enter__(self) -> OrderedPool[Result]:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.pool:
            self.pool.shutdown(cancel_futures=True)

    def submit(self, tag: Any, *args: Any) -> Iterator[tuple[Any, Result]]:
        if self.pool is None:
            yield tag, self.work(*args)
            return
        self.window.append((tag, self.pool.submit(self.work, *args)))
        while len(self.window) >= self.limit:
            done, future = self.window.popleft()
            yield done, future.result()

    def finish(self) -> Iterator[tuple[Any, Result]]:
        while self.window:
            done, future = self.window.popleft()
            yield done, future.result()
