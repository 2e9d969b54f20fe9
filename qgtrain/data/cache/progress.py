"""Progress of a tokenization: a tqdm bar on a terminal; in a Slurm log, where a bar is unreadable,
a line every 30 seconds. Both say documents, tokens, bytes read, throughput and the time left."""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

log = logging.getLogger("qgtrain")
LOG_EVERY_S = 30.0


class Progress:
    def __init__(self, total_bytes: int, files: int) -> None:
        self.total, self.files = max(1, total_bytes), files
        self.finished_bytes = self.bytes = self.documents = self.tokens = self.files_done = 0
        self.start = self.last_line = time.monotonic()
        self.bar: Any = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(
                total=self.total,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc="tokenizing",
                file=sys.stderr,
                mininterval=0.5,
                dynamic_ncols=True,
            )
        else:
            log.info("data: tokenizing %d files, %s", files, _size(total_bytes))

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.close()
        if exc[0] is None:
            log.info("data: tokenized %s", self.summary(final=True))

    def read(self, done_in_file: int) -> None:
        position = self.finished_bytes + done_in_file
        if position > self.bytes:
            if self.bar is not None:
                self.bar.update(position - self.bytes)
            self.bytes = position
        now = time.monotonic()
        if self.bar is None and now - self.last_line >= LOG_EVERY_S:
            self.last_line = now
            log.info("data: %s", self.summary())
        elif self.bar is not None and self.documents % 1024 == 0:
            self.bar.set_postfix_str(
                f"{self.documents:,} docs, {self.tokens:,} tokens", refresh=False
            )

    def next_file(self, size: int) -> None:
        self.finished_bytes += size
        self.files_done += 1
        self.read(0)

    def add_document(self) -> None:
        self.documents += 1

    def add_tokens(self, count: int) -> None:
        self.tokens += count

    def summary(self, final: bool = False) -> str:
        elapsed = max(1e-9, time.monotonic() - self.start)
        rate = self.bytes / elapsed
        left = (self.total - self.bytes) / rate if rate > 0 else 0.0
        done = (
            f"{_size(self.bytes)} of {_size(self.total)} ({100 * self.bytes / self.total:.0f}%), "
            f"{self.files_done}/{self.files} files"
            if not final
            else f"{self.files} files, {_size(self.total)}"
        )
        return (
            f"{done}, {self.documents:,} documents, {self.tokens:,} tokens, {rate / 1e6:.1f} MB/s, "
            + (f"{elapsed:.1f} s" if final else f"{elapsed:.0f} s so far, about {left:.0f} s left")
        )


def _size(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if count < 1000:
            return f"{count:.1f} {unit}"
        count /= 1000
    return f"{count:.1f} TB"
