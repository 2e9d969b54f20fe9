"""How qgtrain writes the small files others read while it runs: whole or not at all, and under a
lock.

A reader (`qgtrain runs` on a login node, a requeued job, another rank) must never see half a file,
so each is written beside its final name and renamed over it. Locks are flocks, released by the
kernel when their holder dies, so they never go stale; a filesystem without locks is used unguarded.

Run directories and data caches may sit in folders others can write, where a name qgtrain opens
can be planted in advance as a link to one of the user's files. So nothing here opens a predictable
name through a link: temporary files and folders get unguessable names and are created only if new
(a link already there fails the creation instead of being followed), and a lock file is opened
without following a link, must be a plain file, and is never truncated.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import io
import os
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path

from .errors import QgtrainError

# what a filesystem without flock answers
_NO_LOCKS = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP)
# A lock file holds who holds it, padded to this size: rewritten, never truncated.
HOLDER_BYTES = 200


def temp_name(target: Path) -> Path:
    """A name beside `target` that no one can predict: `<name>.tmp-<random>`, which is what the
    sweeps of leftovers look for."""
    return target.with_name(f"{target.name}.tmp-{secrets.token_hex(6)}")


def make_temp_dir(target: Path) -> Path:
    """A new folder beside `target`, to be filled and renamed over it. Made with the umask's mode
    (others read the renamed entry, as they read a cache entry), and only if the name was free."""
    while True:
        tmp = temp_name(target)
        try:
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue


def write_atomic(path: Path, content: str | bytes, mode: int = 0o644) -> None:
    """Write `path` whole: a new file under an unguessable name, renamed over it (a link planted at
    `path` is replaced, never written through). Never writable by its group or others, whatever
    the umask (a job file they could edit runs as you); `mode` may take more away."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        tmp = temp_name(path)
        try:
            fd = os.open(tmp, flags, mode & ~0o022)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(content.encode() if isinstance(content, str) else content)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_append(path: Path) -> io.TextIOWrapper:
    """`path` opened to append text (a log), created owner-writable only if missing. Never through
    a link, and only a plain file: a name planted in advance as a link to one of your files (or a
    FIFO) is refused in one line naming it."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    not_plain = QgtrainError(
        f"{path} is not a plain file (a folder, a FIFO or a device), where qgtrain appends "
        "to a log. HINT: remove it"
    )
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.EISDIR):  # a FIFO no one reads, a folder
            raise not_plain from None
        if exc.errno != errno.ELOOP:
            raise
        raise QgtrainError(
            f"{path} is a symbolic link where qgtrain appends to a log; a log is never "
            "written through a link (it could point at any file). HINT: remove the link"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise not_plain
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a", encoding="utf-8")


@contextlib.contextmanager
def owner_writes_only() -> Iterator[None]:
    """Take write permission from the group and others in the umask while a command writes into a
    run directory: what torch, TensorBoard, submitit and mkdir create there with the umask's mode
    (checkpoints, events, submitit's pickled job, folders) would otherwise be group-writable under
    the umask 002 of many group project folders, and a job file a colleague can edit runs as you.
    Reading is left as the umask says (logging.shared)."""
    old = os.umask(0o077)
    os.umask(old | 0o022)
    try:
        yield
    finally:
        os.umask(old)


def open_lock(path: Path, mode: int) -> int:
    """The lock file's descriptor, created with `mode` if missing; opened for writing, since NFS
    grants an exclusive flock only to a writer. A link, or anything but a plain file with one name,
    is refused with one line naming it."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise QgtrainError(
            f"{path} is a symbolic link where qgtrain keeps a lock file; a lock is "
            "never opened through a link (it could point at any file). "
            "HINT: remove the link"
        ) from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        raise QgtrainError(
            f"{path} is not a plain file of its own (a folder, a device or a hard "
            "link to another file), where qgtrain keeps a lock file. "
            "HINT: remove it"
        )
    return fd


def write_holder(fd: int, holder: str) -> None:
    """Say who holds the lock, over the previous holder's record (never truncating the file)."""
    os.pwrite(fd, holder.encode()[:HOLDER_BYTES].ljust(HOLDER_BYTES), 0)


def read_holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it. Anyone who could write the file could write this,
    so it is shown with control characters replaced."""
    text = os.pread(fd, HOLDER_BYTES, 0).decode(errors="replace").strip()
    return "".join(c if c.isprintable() else "?" for c in text)


def try_lock(fd: int, shared: bool = False) -> bool | None:
    """Take the lock without waiting: True if taken, False if another process holds it, None where
    the filesystem has no locks."""
    try:
        fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in _NO_LOCKS:
            return None
        raise
