"""A code snapshot on disk is sealed, and checked before anything runs from it.

`<run dir>/code/<hash>/` is named by the hash of what it holds, and every attempt of a job (requeues
days later included) runs it. A run folder sits in a group's project folder, so a name alone proves
nothing: a colleague could swap the folder, or edit a file in it, and the next attempt would run
their code as the user. So the copy is made read-only (owner-only, or group-readable for a shared
run), and before it is reused and at every start its files must be the user's, writable by no one
else, and hash to its name again; otherwise nothing runs. Hashing reads links as links, never what
they point at. No torch here.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat
from pathlib import Path

from ..foundation.errors import QgtrainError

RECORD = "snapshot.json"  # beside the files; not hashed (it holds the hash)
HASH_NAME = re.compile(r"[0-9a-f]{16}")
_WRITE_BITS = stat.S_IWGRP | stat.S_IWOTH


class SnapshotChanged(QgtrainError):
    """A code snapshot (or the job record naming it) is not what qgtrain made at submit."""


def contents(path: Path) -> bytes:
    if path.is_symlink():
        return os.readlink(path).encode(errors="surrogateescape")
    return path.read_bytes()


def entries_digest(entries: list[tuple[str, Path]]) -> str:
    """The hash of the names and contents, in the order given (name order)."""
    total = hashlib.sha256()
    for name, path in entries:
        total.update(name.encode(errors="surrogateescape") + b"\0")
        total.update(hashlib.sha256(contents(path)).digest())
    return total.hexdigest()[:16]


def folder_entries(folder: Path) -> list[tuple[str, Path]]:
    """A snapshot's own files and links, named as they were when copied in, in name order: what
    hashes to the folder's name when nothing was changed."""
    found = []
    for parent, dirs, files in os.walk(folder):
        links = [d for d in dirs if Path(parent, d).is_symlink()]
        for name in files + links:
            path = Path(parent, name)
            relative = path.relative_to(folder).as_posix()
            if relative != RECORD:
                found.append((relative, path))
    return sorted(found)


def verify(folder: Path) -> None:
    """Raise SnapshotChanged unless `folder` is a snapshot as qgtrain made it: named by a hash, not
    a link, everything in it the user's and writable by no one else, and its files hashing to its
    name. Ownership comes first, so nothing someone else planted (a FIFO) is ever read."""
    folder = Path(folder)
    if not HASH_NAME.fullmatch(folder.name):
        _refuse(folder, "is not named by a code snapshot's hash")
    problem = _foreign(folder)
    if problem:
        _refuse(folder, problem)
    found = entries_digest(folder_entries(folder))
    if found != folder.name:
        _refuse(folder, f"holds files that hash to {found}, not to its name: they changed")


def _foreign(folder: Path) -> str | None:
    try:
        if folder.is_symlink():
            return "is a symbolic link"
        paths = [folder]
        for parent, dirs, files in os.walk(folder):
            paths += [Path(parent, name) for name in dirs + files]
        for path in paths:
            info = os.lstat(path)
            if info.st_uid != os.getuid():
                return f"holds {path}, which belongs to uid {info.st_uid}, not to you"
            kind = stat.S_IFMT(info.st_mode)
            if kind not in (stat.S_IFREG, stat.S_IFDIR, stat.S_IFLNK):
                return f"holds {path}, which is neither a file, a folder nor a link"
            if kind != stat.S_IFLNK and info.st_mode & _WRITE_BITS:
                return f"holds {path}, which others can write (mode {info.st_mode & 0o777:o})"
    except OSError as exc:
        return f"cannot be checked ({exc.strerror}: {exc.filename})"
    return None


def _refuse(folder: Path, problem: str) -> None:
    raise SnapshotChanged(
        f"the code snapshot {folder} {problem}; it is not the code that was snapshotted, so "
        "nothing runs from it. HINT: if you did not change it, someone who can write the run "
        "folder did; remove it (chmod -R u+w first) and submit the job again"
    )


def seal(folder: Path, shared: bool) -> None:
    """Make a finished copy read-only: files 0400 (0500 if the owner could run them), folders 0500;
    with the group's read (and search) bits too for a shared run. The source's mode and the umask
    count for nothing: a key left 0644 in the submit directory would otherwise stay readable."""
    group = 0o050 if shared else 0
    for parent, dirs, files in os.walk(folder, topdown=False):
        for name in files:
            path = Path(parent, name)
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode):
                runnable = info.st_mode & stat.S_IXUSR
                path.chmod(0o500 | group if runnable else 0o400 | (group & 0o040))
        for name in dirs:
            if not Path(parent, name).is_symlink():
                Path(parent, name).chmod(0o500 | group)
    folder.chmod(0o500 | group)


def remove(folder: Path) -> None:
    """Remove a sealed (read-only) snapshot or a half-made copy: its folders are made writable
    first, or rmtree would fail on the first file."""
    for parent, dirs, _ in os.walk(folder):
        for name in [".", *dirs]:
            path = Path(parent, name)
            if not path.is_symlink():
                try:
                    path.chmod(stat.S_IRWXU)
                except OSError:
                    pass  # not ours: rmtree leaves what it cannot remove
    shutil.rmtree(folder, ignore_errors=True)
