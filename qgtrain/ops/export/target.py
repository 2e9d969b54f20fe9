"""Where an export may go: a new folder, an empty one, or (with --force) an earlier qgtrain export.

An export replaces its folder whole, so whatever else the folder held would be deleted: a folder of
other models, a home directory given by a typo. No flag deletes those: --force asks to replace an
earlier export, recognised by the qgtrain_model.json that every export holds.
"""

from __future__ import annotations

from pathlib import Path

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
