"""Where `qgtrain eval` writes its results and samples, and whose eval.tasks it scores.

Runs and exports sit in shared folders, and a colleague's run may hold an `eval -> <your run>/eval`
link, or name in its config task files only you can read. Writing through the first would replace
your samples and add results lines that make your own next eval skip checkpoints as "already
scored"; scoring the second would copy your files' prompts and answers into their folder. So a run
or export is scored into its own `eval/` only when it is yours by foundation/trust.py's rule (the
folder, each folder down to its config, and the config owned by you, writable by no one else, the
config no link); anyone else's is scored into a folder of yours (`--out`, by default
<logging.runs_dir>/eval-of-<name>), and its own eval.tasks are never read. Either folder is checked
before anything is written: not a link, yours, writable by no one else, and its results and samples
no links.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ..foundation.errors import QgtrainError
from ..foundation.trust import not_yours, ownership_problem
from ..runs.rundir import RunDir
from .export.writer import META

WRITTEN = re.compile(r"results\.jsonl|step-\d+\.jsonl")


@dataclass(frozen=True)
class Destination:
    """`folder` takes results.jsonl and step-<N>.jsonl; `source` is what each results line names
    when that folder is not the scored folder's own eval/ (a line stands for its source only);
    `not_yours` says why the scored folder is someone else's (None when it is the user's)."""

    folder: Path
    source: str | None
    not_yours: str | None


def whose(source: Path, export: bool) -> str | None:
    """None when `source` is the user's to write in and to take eval.tasks from; otherwise why
    not."""
    return not_yours(source, source / META if export else RunDir(source).config)


def default_out(source: Path, runs_dir: str | Path) -> Path:
    return Path(runs_dir) / f"eval-of-{source.resolve().name}"


def destination(
    source: Path, why: str | None, out: Path | None, runs_dir: str | Path
) -> Destination:
    """The folder results and samples go to, made (0700) if missing and checked: the scored
    folder's own eval/ when it is the user's and no --out is given, else `out` or the default."""
    own = source / "eval"
    folder = out if out is not None else (own if why is None else default_out(source, runs_dir))
    checked(folder)
    named = None if out is None and why is None else str(source.resolve())
    return Destination(folder, named, why)


def checked(folder: Path) -> None:
    """Refuse (exit 2, one line) a folder that is a link, someone else's or writable by others,
    or that holds results or samples that are links, before anything is written into it."""
    if not os.path.lexists(folder):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    problem = _problem(folder)
    if problem is not None:
        path, why = problem
        raise QgtrainError(
            f"eval: {why}, where qgtrain writes evaluation results and samples; they are written "
            "only into a folder of yours that no one else can write, never through a link (it "
            f"could lead to anyone's files). HINT: {_fix(path, why)}"
        )


def _problem(folder: Path) -> tuple[Path, str] | None:
    try:
        why = ownership_problem(folder, os.lstat(folder))
        if why is not None:
            return folder, why
        if not folder.is_dir():
            return folder, f"{folder} is not a folder"
        with os.scandir(folder) as listing:
            found = [Path(e.path) for e in listing if WRITTEN.fullmatch(e.name)]
        for path in sorted(found):
            info = os.lstat(path)
            why = ownership_problem(path, info)
            if why is None and not stat.S_ISREG(info.st_mode):
                why = f"{path} is not a plain file"
            if why is not None:
                return path, why
    except OSError as exc:
        return Path(exc.filename or folder), f"{exc.filename or folder} cannot be checked"
    return None


def _fix(path: Path, why: str) -> str:
    if why.endswith("symbolic link"):
        return f"remove the link ({path}), or pass --out DIR, a folder of yours"
    if "writable by" in why:
        return f"chmod g-w,o-w {path} once you have checked what it holds, or pass --out DIR"
    return "pass --out DIR, a folder of yours"
