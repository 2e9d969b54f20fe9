"""The lock file of a cache entry being tokenized (prepare.py): concurrent jobs that need the same
entry wait for the one that holds it instead of doing the work twice, say whom they wait for, and
give up after data.prepare_timeout_s naming the lock to remove. Where the filesystem has no locks
the caller proceeds without one (prepare's rename alone keeps jobs from corrupting each other).

An entry's modes are set here too, whatever the umask: a cache holds the text of the files it was
made from, so it is the user's alone (0700 folder, 0600 files) unless logging.shared says the
group may read it (0750, 0640); never writable by the group, whose edit of a token file would
change what the user trains on. The folder stays 0700 while it is filled."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from ...foundation.errors import ConfigError
from ...foundation.files import make_temp_dir, open_lock, read_holder, try_lock, write_holder

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


def private_temp_dir(folder: Path) -> Path:
    """A new folder to fill and rename to `folder`, that no one else can enter meanwhile."""
    tmp = make_temp_dir(folder)
    os.chmod(tmp, 0o700)
    return tmp


def seal(tmp: Path, shared: bool) -> None:
    """Set the filled folder's modes before it is renamed into place (it holds only files)."""
    for path in tmp.iterdir():
        os.chmod(path, 0o640 if shared else 0o600)
    os.chmod(tmp, 0o750 if shared else 0o700)
