"""How qgtrain writes the small files others read while it runs: whole or not at all, and under a lock.

A reader (`qgtrain runs` on a login node, a requeued job, another rank) must never see half a file, so
each is written beside its final name and renamed over it. Locks are flocks, released by the kernel when
their holder dies, so they never go stale; a filesystem without locks is used unguarded.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)  # what a filesystem without flock answers


def write_atomic(path: Path, content: str | bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    if isinstance(content, str):
        tmp.write_text(content)
    else:
        tmp.write_bytes(content)
    os.replace(tmp, path)


def try_lock(fd: int, shared: bool = False) -> bool | None:
    """Take the lock without waiting: True if taken, False if another process holds it, None where the
    filesystem has no locks."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            return None
        raise
