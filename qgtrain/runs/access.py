"""Who could have written what a run directory holds: the walk behind rundir.require_safe.

Run directories sit in group project folders. What qgtrain finds in one is run as the user (the job
script, its config, the code snapshot) or written to by name (logs, metrics, status), so it must
all have been written by the user: inside a folder only its owner can write, every entry was made by
that owner (or root), which is why the folders are checked before what they hold. The rule is
foundation/trust.py's, for the code an export names (ownership_problem), applied to a run.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ..foundation.trust import ownership_problem


@dataclass(frozen=True)
class Finding:
    """What makes a run directory unsafe, and the entry it is about (its lstat, if it could be
    read)."""

    why: str
    path: Path
    info: os.stat_result | None

    @property
    def owner(self) -> str:
        if self.info is None:
            return "unknown"
        try:
            return pwd.getpwuid(self.info.st_uid).pw_name
        except KeyError:
            return f"uid {self.info.st_uid}"

    @property
    def mode(self) -> str:
        return f"{stat.S_IMODE(self.info.st_mode):04o}" if self.info else "unknown"


def problem(
    top: Path,
    walked: tuple[Path, ...],
    no_links: tuple[Path, ...],
    contained: tuple[Path, ...] = (),
) -> Finding | None:
    """The first entry of `top` that someone else could have written: `top` itself (a link of the
    user's, e.g. to scratch space, is followed), every entry at its top, and everything below the
    `walked` folders. A walked folder, and anything at or below `no_links`, is never a link (job
    files are kept there), whoever made it; below a `contained` folder (code qgtrain does not make
    itself: inductor's, submitit's pickles) a link must lead back inside it; links the user made
    elsewhere (checkpoints on scratch space, a link in the code snapshot) are theirs. None for a
    `top` that does not exist."""
    try:
        link = os.lstat(top)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return Finding(f"{top} cannot be checked ({exc.strerror})", top, None)
    if stat.S_ISLNK(link.st_mode) and link.st_uid != os.getuid():
        return Finding(f"{top} is a symbolic link made by someone else", top, link)
    path = top
    try:
        for path, info in _entries(top, walked):
            why = _why(path, info, walked, no_links) or _leads_out(path, info, contained)
            if why:
                return Finding(why, path, info)
    except OSError as exc:
        return Finding(f"{exc.filename or path} cannot be checked ({exc.strerror})", path, None)
    return None


def _entries(top: Path, walked: tuple[Path, ...]) -> Iterator[tuple[Path, os.stat_result]]:
    """Each entry with its lstat, a folder before what it holds (nothing is read from a folder
    before its own check passed: the walk stops at the first problem)."""
    yield top, os.stat(top)
    yield from _below(top, deep=False)
    for folder in walked:
        if stat.S_ISDIR(_lstat_mode(folder)):
            yield from _below(folder, deep=True)


def _below(folder: Path, deep: bool) -> Iterator[tuple[Path, os.stat_result]]:
    """The entries of `folder`, and if `deep` everything under it."""
    with os.scandir(folder) as listing:
        found = [(Path(e.path), e.stat(follow_symlinks=False)) for e in listing]
    for path, info in found:
        yield path, info
        if deep and stat.S_ISDIR(info.st_mode):
            yield from _below(path, deep=True)


def _lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return 0


def _why(
    path: Path, info: os.stat_result, walked: tuple[Path, ...], no_links: tuple[Path, ...]
) -> str | None:
    if not stat.S_ISLNK(info.st_mode):
        return ownership_problem(path, info)
    if path in walked or any(path == f or f in path.parents for f in no_links):
        return f"{path} is a symbolic link where qgtrain keeps job files"
    if info.st_uid != os.getuid():
        return f"{path} is a symbolic link made by someone else"
    return None  # the user's own link (checkpoints on scratch space), as the top may be


def _leads_out(path: Path, info: os.stat_result, contained: tuple[Path, ...]) -> str | None:
    """Why a link below a `contained` folder does not count: it leads out of it (a copied run's
    link to a colleague's file would load that file as the user's)."""
    if not stat.S_ISLNK(info.st_mode):
        return None
    for folder in contained:
        if folder in path.parents:
            inside = Path(os.path.realpath(folder))
            target = Path(os.path.realpath(path))
            if target != inside and inside not in target.parents:
                return f"{path} is a symbolic link leading out of {folder} (to {target})"
    return None
