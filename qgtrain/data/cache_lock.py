"""The lock file of a cache entry being tokenized (prepare.py): concurrent jobs that need the same
entry wait for the one that holds it instead of doing the work twice, say whom they wait for, and
give up after data.prepare_timeout_s naming the lock to remove. Where the filesystem has no locks
the caller proceeds without one (prepare's rename alone keeps jobs from corrupting each other)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from ..foundation.errors import ConfigError
from ..foundation.files import open_lock, read_holder, try_lock, write_holder

log = logging.getLogger("qgtrain")


def is_ready(folder: Path) -> bool:
    return (folder / "meta.json").is_file()


@contextlib.contextmanager
def entry_lock(folder: Path, timeout_s: float) -> Iterator[bool]:
    """Hold the entry's lock file; yields False where the filesystem has no locks (then proceed
    without). Created with the umask's mode: in a cache a group shares, each member must take it."""
    path = folder.with_name(f"{folder.name}.lock")
    fd = open_lock(path, 0o666)
    try:
        start, said = time.monotonic(), 0.0
        while (taken := try_lock(fd)) is not True:
            if taken is None:
                yield False
                return
            waited = time.monotonic() - start
            if is_ready(folder):  # the other job finished: nothing left to hold the lock for
                yield False
                return
            if waited > timeout_s:
                raise ConfigError(
                    f"data.prepare_timeout_s: waited {waited:.0f} s for "
                    f"{read_holder(fd) or 'another job'} to finish tokenizing into "
                    f"{folder}; remove {path} if that job is gone"
                )
            if waited >= said:
                log.info(
                    "data: waiting for %s, which is tokenizing into %s",
                    read_holder(fd) or "another job",
                    folder,
                )
                said = waited + 60
            time.sleep(0.5)
        write_holder(fd, f"process {os.getpid()} on {socket.gethostname()}")
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)
