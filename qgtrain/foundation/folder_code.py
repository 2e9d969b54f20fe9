"""Whether Python that a folder asks a library to run may run, decided by qgtrain before the library
reads the folder: never by transformers' "run the custom code? [y/N]" prompt on stdin.

A transformers folder names code in its config.json (`auto_map`, or a `model_type` transformers
does not know, which only the folder's code could build) or its tokenizer_config.json
(`auto_map`); given trust_remote_code, transformers imports the folder's .py files as you, and
without it, where the type is unknown, it asks on stdin. An lm-evaluation-harness task folder
(`--include-path`) is code outright: its YAMLs' `!function utils.fn` import the folder's Python.
Such code runs only when both hold:

1. The user said so, having read it: `--trust-code` (`trust_code=True` in Python) where the
   command has it (`trusting`). Training reads model.pretrained and data.tokenizer with no such
   flag, so nothing a folder names runs there.
2. The folder is the user's: it and everything under it belong to them and no one else can write
   them (trust.ownership_problem), so the code that runs is the code they read.

Every transformers loader qgtrain calls is given trust_remote_code by `remote_code` (False unless
both hold), so transformers never asks; a folder that names code without them is refused in one
line naming the file, the key and the fix.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from .trust import UntrustedCode, ownership_problem

CODE_FILES = ("config.json", "tokenizer_config.json")  # what transformers' Auto classes read
NO_FLAG = (
    "training has no --trust-code and runs no code from the folders it reads: give a folder of a "
    "model transformers builds itself (a model_type it knows, no auto_map in config.json or "
    "tokenizer_config.json)"
)


@dataclass(frozen=True)
class _Trust:
    trusted: bool
    fix: str  # how the user says they trust it; empty where nothing can (training)


_TRUST: ContextVar[_Trust] = ContextVar("qgtrain_folder_code", default=_Trust(False, ""))
P = ParamSpec("P")
R = TypeVar("R")


@contextlib.contextmanager
def trusting(trusted: bool, fix: str) -> Iterator[None]:
    """Inside, folders that name code may run it if `trusted` (and the folder is the user's);
    `fix` says how the user would trust it (`--trust-code`)."""
    token = _TRUST.set(_Trust(trusted, fix))
    try:
        yield
    finally:
        _TRUST.reset(token)


def trusting_its_flag(fix: str) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Run the decorated command inside trusting(its `trust_code` argument, `fix`): the one flag
    that lets it import a run's factories lets it run the code of the folders it reads too."""

    def decorate(command: Callable[P, R]) -> Callable[P, R]:
        signature = inspect.signature(command)

        @functools.wraps(command)
        def run(*args: P.args, **kwargs: P.kwargs) -> R:
            given = signature.bind(*args, **kwargs)
            given.apply_defaults()
            with trusting(bool(given.arguments["trust_code"]), fix):
                return command(*args, **kwargs)

        return run

    return decorate


def remote_code(folder: str | Path, what: str) -> bool:
    """The trust_remote_code for a transformers loader reading `folder` (`what`: the setting or
    command reading it): False where it names no code; True where it does and may run it;
    otherwise UntrustedCode, before transformers has seen the folder."""
    folder = Path(folder)
    named = named_code(folder)
    if named is None:
        return False
    file, key = named
    code = f"{file} names code for transformers to import from {folder} ({key})"
    require_trusted(folder, code, what)
    return True


def require_trusted(folder: Path, code: str, what: str) -> None:
    """Raise UntrustedCode unless the user trusts `folder`'s code (`trusting`) and the folder is
    theirs alone; `code` says what in it would run."""
    trust = _TRUST.get()
    if not trust.trusted:
        fix = f"read it; pass {trust.fix} if you trust {folder}'s code" if trust.fix else NO_FLAG
        raise UntrustedCode(f"{what}: {code}, which would run as you; it was not run. HINT: {fix}")
    problem = tree_problem(folder)
    if problem is not None:
        raise UntrustedCode(
            f"{what}: {code}, and {problem}, so what runs may not be what you read; it was not "
            "run. HINT: use a copy of your own (cp -rL) that no one else can write "
            "(chmod -R g-w,o-w), once you have read its code"
        )


def named_code(folder: Path) -> tuple[Path, str] | None:
    """The file of `folder` that names code for transformers to run, and how, or None."""
    configs = {name: _json(folder / name) for name in CODE_FILES}
    for name, config in configs.items():
        if config.get("auto_map"):
            return folder / name, f"auto_map: {', '.join(_strings(config['auto_map']))}"
    model_type = configs["config.json"].get("model_type")
    if isinstance(model_type, str) and model_type and not _known(model_type):
        unknown = f"model_type {model_type!r}, which transformers does not know"
        return folder / "config.json", unknown
    return None


def tree_problem(top: Path) -> str | None:
    """Why `top` or anything under it could hold what someone else wrote (trust.ownership_problem:
    a link, another owner, write bits for its group or others), or None."""
    try:
        for path in _tree(top.resolve(strict=True)):
            problem = ownership_problem(path, os.lstat(path))
            if problem is not None:
                return problem
    except OSError as exc:
        return f"{exc.filename} cannot be checked ({exc.strerror})"
    return None


def _tree(top: Path) -> Iterator[Path]:
    """`top`, then everything under it; a folder that cannot be listed raises."""

    def fail(exc: OSError) -> None:
        raise exc

    yield top
    if top.is_dir():
        for folder, dirs, files in os.walk(top, onerror=fail):
            yield from (Path(folder, name) for name in sorted(dirs + files))


def _json(path: Path) -> dict[str, Any]:
    """A config file as transformers reads it; {} where it cannot (transformers then says why)."""
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    return [] if value is None else [str(value)]


def _known(model_type: str) -> bool:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING
