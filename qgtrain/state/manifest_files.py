"""Which files a checkpoint's manifest may list, and opening and checksumming them safely.

A manifest is written by whoever wrote the checkpoint folder, and on a shared filesystem that may
be someone else. Its names are trusted only as far as they stay inside the folder: a relative path
of plain names (no absolute path, no `..` or `.`), every folder on the way a real folder (not a
symlink), the file itself a regular file. Anything else would make verification read files outside
the checkpoint, and a FIFO or a device would hang resume and export forever: such a checkpoint is
damaged. qgtrain writes only regular files and folders into a checkpoint, so nothing else in one
is accepted either, listed or not: the files read by fixed names (model.json, config.yaml) are
safe to open once the checkpoint verifies.
"""

from __future__ import annotations

import mmap
import os
import stat
from pathlib import Path
from typing import Any

import xxhash

from ..foundation.errors import CheckpointError

_KINDS = (
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)
_WINDOW = 16 << 20  # a multiple of mmap's allocation granularity


class UnsafeFile(CheckpointError):
    """A file that is not a regular file inside the checkpoint folder; the message says what."""


def listing_problem(manifest: dict[str, Any], where: Path) -> str | None:
    """What is wrong with a manifest's list of files (`where` names the manifest), or None: every
    name stays inside the folder and every entry has a size and a checksum. Reads nothing."""
    files = manifest.get("files", {})
    if not isinstance(files, dict):
        return f"{where} lists its files as a {type(files).__name__}, not as names with entries"
    for name, entry in files.items():
        why = name_problem(name)
        if why:
            return (
                f"{where} lists the file {name!r}, which {why}: a checkpoint lists only files "
                "inside its folder"
            )
        if not (
            isinstance(entry, dict)
            and type(entry.get("size")) is int
            and entry["size"] >= 0
            and isinstance(entry.get("xxh3"), str)
        ):
            return f"{where} has no size and checksum for {name!r}"
    return None


def name_problem(name: object) -> str | None:
    """Why a listed name could reach outside the checkpoint folder; None for a plain relative."""
    if not isinstance(name, str) or not name or "\0" in name:
        return "is not a file name"
    if name.startswith("/"):
        return "is an absolute path"
    if any(part in ("", ".", "..") for part in name.split("/")):
        return "is not a plain relative path (it has a '..', '.' or empty part)"
    return None


def stray_problem(folder: Path) -> str | None:
    """The first thing in the checkpoint folder, listed or not, that is neither a regular file nor a
    real folder (a symlink, a FIFO, a device), or None."""
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                problem = stray_problem(Path(entry.path))
                if problem:
                    return problem
            elif not entry.is_file(follow_symlinks=False):
                what = kind(entry.stat(follow_symlinks=False))
                return f"{entry.path} is {what}, which a checkpoint never holds"
    return None


def regular_file(folder: Path, name: str) -> os.stat_result:
    """The lstat of `folder/name` (a name `name_problem` accepts) if it is a regular file reached
    through real folders; else UnsafeFile. A missing file raises FileNotFoundError like any stat."""
    path = folder
    for part in name.split("/")[:-1]:
        path = path / part
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            what = kind(os.lstat(path))
            raise UnsafeFile(f"{path} is {what}, not a folder inside the checkpoint")
    path = folder / name
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise UnsafeFile(f"{path} is {kind(info)}, not a regular file")
    return info


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path` if it is a regular file, else UnsafeFile. The open neither
    follows a symlink nor waits for a FIFO's writer (O_NOFOLLOW, O_NONBLOCK), and the kind is
    checked on what was opened, so a file swapped after a check is caught too."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        if os.path.islink(path):
            raise UnsafeFile(f"{path} is a symbolic link, not a regular file") from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UnsafeFile(f"{path} is {kind(info)}, not a regular file")
    return fd


def digest(path: Path) -> str:
    """xxh3-128 of a regular file, read through mmap (half the time of chunked reads, as fast as the
    page cache) a window at a time: a process that checks a 16 GB shard holds 16 MiB of it, not
    16 GB, in its memory."""
    hasher = xxhash.xxh3_128()
    with os.fdopen(open_regular(path), "rb") as f:
        size = os.fstat(f.fileno()).st_size
        for offset in range(0, size, _WINDOW):
            window = min(_WINDOW, size - offset)
            with mmap.mmap(f.fileno(), window, access=mmap.ACCESS_READ, offset=offset) as view:
                hasher.update(view)
    return hasher.hexdigest()


def read_regular(path: Path) -> bytes:
    """The whole content of a regular file (open_regular's rules)."""
    with os.fdopen(open_regular(path), "rb") as f:
        return f.read()


def kind(info: os.stat_result) -> str:
    return next((what for test, what in _KINDS if test(info.st_mode)), "not a regular file")
