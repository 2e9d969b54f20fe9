"""Whether qgtrain may import the code an artifact names, decided before anything is imported.

A checkpoint's `config.yaml` names factories (task.factory, model.factory, data.factory), and an
export's `qgtrain_model.json` names them too, with the model's class. Reading those files reads data
that someone wrote; importing what they name runs that someone's code as you. `qgtrain export` and
`qgtrain.load_model` import a name only when one of these holds:

1. It is built in (`Named.builtin`): the built-in language model's task function (BUILTIN_LM), or,
   as an exported model's class, a class inside transformers (load.py checks that it is a
   PreTrainedModel; its from_pretrained runs no code from the folder). Nothing else is: a function
   of qgtrain is called with the artifact's config, and `qgtrain.launch.submitit_launcher:submit`
   called so would submit that config (its `slurm.setup` lines) as a job of yours.
2. The user says so after reading the code: `--trust-code` / `trust_code=True`.
3. For `qgtrain export` only, the run is yours (`not_yours` is None): the folder given, each folder
   from it down to the config.yaml read, and that file belong to you, none is writable by its group
   or others, and the file is not a symbolic link. Then only you (or root) can have written that
   config, so it names the code you trained with, as a config file you train names code you chose.
   A copy you made of someone's run is yours by this rule, as a copied config file is.

An export folder is never trusted by its owner: it is made to be passed around like a Hugging Face
folder, and a copy, download or `git clone` belongs to whoever made it, so its owner says nothing of
who wrote its qgtrain_model.json (a cloned folder in the working directory is even importable).

The same ownership rule keeps a run folder's code the user's (rundir.require_safe), and ssh's rule
for the folders above ~/.ssh keeps anyone from swapping the run folder itself (`open_above`).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import QgtrainError
from .task import BUILTIN_LM

BUILTIN_FACTORIES: dict[str, tuple[str, ...]] = {"task.factory": (BUILTIN_LM,)}
CLASS_PACKAGES = ("transformers",)


class UntrustedCode(QgtrainError):
    """An artifact names code that is not built in, and nothing says the user trusts it."""


@dataclass(frozen=True)
class Named:
    key: str  # task.factory, model.factory, data.factory, or class (an exported model's)
    spec: str  # 'package.module:function', 'path/to/file.py:function' or 'package.module.Class'

    def builtin(self) -> bool:
        if self.key == "class":
            return self.spec.split(".")[0] in CLASS_PACKAGES
        return self.spec in BUILTIN_FACTORIES.get(self.key, ())


def config_code(cfg: Any) -> list[Named]:
    """The factories of a RunConfig that export and load_model may call. Both rebuild the built-in
    language model from model.* alone, never its data: data.factory counts beside a task only."""
    builtin = cfg.task.factory == BUILTIN_LM
    named = []
    if not builtin:
        named.append(Named("task.factory", cfg.task.factory))
    if cfg.model.factory:
        named.append(Named("model.factory", cfg.model.factory))
    if cfg.data.name == "factory" and cfg.data.factory and not builtin:
        named.append(Named("data.factory", cfg.data.factory))
    return named


def require(named: list[Named], where: Path, *, why_not: str, fix: str, what: str) -> None:
    """Raise UntrustedCode naming every piece of code that would run, unless all of it is built in;
    `why_not` says why the artifact does not count as the user's, `fix` how to trust it."""
    foreign = [n for n in named if not n.builtin()]
    if foreign:
        code = ", ".join(f"{n.key} {n.spec!r}" for n in foreign)
        raise UntrustedCode(
            f"{what}: {code} in {where} is code outside qgtrain and transformers, "
            f"and {why_not}, so it was not imported. HINT: read that code; if you "
            f"trust it, pass {fix}"
        )


def not_yours(top: Path, file: Path) -> str | None:
    """None when `top`, each folder from it down to `file`, and `file` (not a link) are the current
    user's and writable by no one else; otherwise the first that is not, and why."""
    top, file = Path(top), Path(file)
    try:
        parts = file.relative_to(top).parts
    except ValueError:
        top, parts = file.parent, (file.name,)
    folders = [top.joinpath(*parts[:i]) for i in range(len(parts))]
    try:
        for path, info in [(f, os.stat(f)) for f in folders] + [(file, os.lstat(file))]:
            problem = ownership_problem(path, info)
            if problem:
                return problem
    except OSError as exc:
        return f"{exc.filename} cannot be checked ({exc.strerror})"
    return None


def ownership_problem(path: Path, info: os.stat_result) -> str | None:
    """Why `path` (its lstat) could hold what someone else wrote: a link, another owner, or write
    bits for its group or others. Shared by the code rule above and the run directory's
    (rundir.require_safe)."""
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link"
    if info.st_uid != os.getuid():
        return f"{path} belongs to uid {info.st_uid}, not to you (uid {os.getuid()})"
    bits = ((stat.S_IWGRP, "its group"), (stat.S_IWOTH, "others"))
    writers = [who for bit, who in bits if info.st_mode & bit]
    return f"{path} is writable by {' and '.join(writers)}" if writers else None


def open_above(path: Path) -> tuple[str | None, str | None]:
    """ssh's rule for the folders above ~/.ssh, for the folders above `path` up to the root:
    whoever may rename entries of one of them can move `path` away and put a folder of their own
    in its place after every check of `path` itself. The sticky bit (/tmp's 1777) leaves renaming
    to an entry's owner. Returns (refusal, warning): refused where every user of the machine may
    rename; a warning naming the folders where a group, or another user owning the folder, may
    (a group project folder under umask 002: the run stops if it happens, Pinned)."""
    warned, fixes = [], []
    for folder in _above(path):
        try:
            info = os.stat(folder)
        except OSError:
            continue  # made later, by qgtrain, as the user
        mode, sticky = stat.S_IMODE(info.st_mode), info.st_mode & stat.S_ISVTX
        if not sticky and mode & stat.S_IWOTH:
            return (
                f"{folder} (mode {mode:04o}), above {path}, can be written by every user of this "
                f"machine, who could put a folder of their own in place of {path} while qgtrain "
                f"uses it. HINT: chmod +t {folder} (then only an entry's owner may rename it), or "
                f"chmod o-w {folder}"
            ), None
        if not sticky and mode & stat.S_IWGRP:
            warned.append(f"{folder} (mode {mode:04o}) is writable by its group")
            fixes.append(f"chmod +t {folder} (then only an entry's owner may rename it)")
        elif info.st_uid not in (0, os.getuid()):
            warned.append(f"{folder} belongs to uid {info.st_uid}")
            fixes.append("keep runs in a folder of your own")
    if not warned:
        return None, None
    return None, (
        f"{'; '.join(warned)}, above {path}: whoever can write there could put a folder of their "
        f"own in place of {path} while qgtrain uses it (a run then stops). "
        f"HINT: {'; '.join(dict.fromkeys(fixes))}"
    )


def _above(path: Path) -> list[Path]:
    """The folders above `path` as the kernel resolves it, and above the link itself where
    `path` is one (the folder holding the link can replace it), nearest first."""
    real = Path(os.path.realpath(path))
    holder = Path(os.path.realpath(Path(os.path.abspath(path)).parent))
    return list(dict.fromkeys([*real.parents, holder, *holder.parents]))
