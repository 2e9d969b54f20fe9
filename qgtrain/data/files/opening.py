"""How a data file is reached and opened: only regular files, and never through a link someone else
planted.

Data folders are shared: a colleague who can write a group's data folder can put a link in it
(`zz.txt -> ~/.ssh/id_ed25519`) that a glob or a folder in data.files would match, and what qgtrain
reads it tokenizes into a cache the colleague reads back; or a FIFO, whose open() would wait for a
writer forever. So a file found by a glob or in a folder is read only if every link on the way from
the root it was named by (the glob's fixed prefix, or the folder) is the user's or root's and it
lands inside that root. A file the user names itself is theirs to name, links and all. Whatever the
path, only a regular file is read: it is opened without waiting (O_NONBLOCK), checked with fstat on
the descriptor that is then read (a file swapped for a FIFO after it was found is caught too), and
only then read as usual.
"""

from __future__ import annotations

import fcntl
import glob
import mmap
import os
import pwd
import stat
from pathlib import Path
from typing import Any, BinaryIO

from ...foundation.errors import ConfigError

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def open_regular(path: str | Path) -> BinaryIO:
    """The file opened for reading, if it is a regular file; anything else is refused in one line
    before a byte is read or waited for."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror})") from None
    try:
        refuse_irregular(os.fstat(fd).st_mode, path)
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def mapped(path: str | Path) -> Any:
    """A pyarrow reader of the whole file, memory-mapped from the descriptor open_regular
    checked (pyarrow's own memory_map would open the path again)."""
    import pyarrow as pa

    with open_regular(path) as handle:
        if os.fstat(handle.fileno()).st_size == 0:  # mmap refuses an empty file
            return pa.BufferReader(b"")
        memory = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    return pa.BufferReader(pa.py_buffer(memory))


def read_text(path: str | Path) -> str:
    with open_regular(path) as handle:
        return handle.read().decode("utf-8", "replace")


def check_regular(path: str | Path) -> None:
    """Cheaply, at expansion: a FIFO or device is never even listed as a data file (open_regular
    still checks the descriptor, in case it is swapped in after)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ConfigError(f"{path}: cannot be read ({exc.strerror})") from None
    refuse_irregular(mode, path)


def refuse_irregular(mode: int, path: str | Path) -> None:
    if stat.S_ISREG(mode):
        return
    what = next((name for test, name in _KINDS if test(mode)), "not a regular file")
    raise ConfigError(
        f"{path} is {what}, not a regular file; qgtrain reads data only from regular files "
        "(it never waits on a FIFO or device): remove it or name only regular files in data.files"
    )


def glob_root(pattern: str) -> str:
    """The folder a glob searches: its path up to the first part with a wildcard."""
    fixed = []
    for part in Path(pattern).parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return os.path.join(*fixed) if fixed else "."


def check_reached(path: str | Path, root: str | Path, key: str) -> None:
    """Refuse `path`, found under `root`, where a link on the way belongs to someone other than the
    user or root, or where it leads outside `root`; the message names both paths."""
    current = os.path.abspath(root)
    for part in Path(os.path.relpath(os.path.abspath(path), current)).parts:
        current = os.path.join(current, part)
        if not os.path.islink(current):
            continue
        owner = os.lstat(current).st_uid
        if owner not in (os.getuid(), 0):
            raise ConfigError(
                f"{key}: {current} is a link owned by {_user(owner)}, not by you or root, to "
                f"{os.path.realpath(current)}; qgtrain does not follow another user's link in a "
                "data folder (it could lead to your files): name the file itself in "
                f"{key} if you mean to read it"
            )
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, real_root]) != real_root:
        raise ConfigError(
            f"{key}: {path} leads to {real}, outside {root} that it was found in; qgtrain does "
            "not follow a link out of a data folder or glob (it could lead to your files): "
            f"name the file itself in {key} if you mean to read it"
        )


def _user(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"
