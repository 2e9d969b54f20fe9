"""Where an export may go: a new folder, an empty one, or (with --force) an earlier qgtrain export.

An export replaces its folder whole, so whatever else the folder held would be deleted: a folder of
other models, a home directory given by a typo. No flag deletes those: --force asks to replace an
earlier export, recognised by the qgtrain_model.json that every export holds.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ...foundation.errors import QgtrainError
from .writer import META


def refusal(out: Path, force: bool) -> str | None:
    """Why an export may not be written to `out` (one line, naming it), or None where it may."""
    if not out.exists():
        return None
    if not out.is_dir():
        return f"export: {out} is a file, not a folder; choose another --out"
    try:
        names = sorted(entry.name for entry in out.iterdir())
    except OSError as exc:
        return f"export: {out} cannot be read ({exc.strerror or exc}); choose another --out"
    if not names:
        return None
    if (out / META).is_file():
        return (
            None
            if force
            else (
                f"export: {out} holds an earlier export; choose another --out "
                "or pass --force to replace it"
            )
        )
    shown = ", ".join(map(repr, names[:3]))
    shown += f" and {len(names) - 3} more" if len(names) > 3 else ""
    return (
        f"export: {out} holds files that are not a qgtrain export ({shown}); an export "
        f"replaces only an empty folder or an earlier export (one with {META}), with --force "
        "too; choose another --out"
    )


def staging(out: Path) -> Path:
    """A fresh folder beside `out`: the export is written there, moved into place once checked."""
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def replace(staging: Path, out: Path, force: bool) -> None:
    """Move the verified export into place; a replaced folder goes only once the new one is there.
    `out` is checked again: files may have arrived there while the export was written."""
    if (refused := refusal(out, force)) is not None:
        raise QgtrainError(refused)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.rename(out, old)
    os.rename(staging, out)
    if old.is_symlink():  # --out was a link to an earlier export: the link goes, not its target
        old.unlink()
    else:
        shutil.rmtree(old, ignore_errors=True)
