"""The code an export of your own model needs, carried inside it: the task file (and a model or data
factory given as a file) with the modules of its own folder that it imports, copied into the
export's `code/` and named relative to the folder in its qgtrain_model.json. `load_model(folder,
trust_code=True)` and `qgtrain eval folder` then build the model from that copy, on any machine and
from any working directory, after the original files have moved or gone.

The modules copied are found by reading import statements (ast), never by importing: `import x`,
`import x.y`, `from x import y` and relative imports, followed into each module found, wherever the
name is a file (or a package's __init__.py) in the task file's folder tree, the folder a script's
imports resolve against (foundation/factory.py puts it on sys.path). A factory named as a module
('package.module:function') is a package installed where the model loads, like any dependency, and
is recorded by name; only a top-level module that is a loose file outside every installed
environment (`my_task:build` found in the working directory) is copied like a task file. Data files
a task reads are not code and are not copied.

Carried code is still code: load_model imports it only with trust_code=True (trust.py), whoever
owns the folder.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import shutil
import sysconfig
from pathlib import Path

from ...config import RunConfig
from ...foundation.errors import CheckpointError
from ...foundation.trust import config_code
from .writer import META

CODE = "code"


def bundled(cfg: RunConfig, folder: Path) -> tuple[RunConfig, list[str]]:
    """Copy the code `cfg`'s factories name into `folder`/code; `cfg` with those factories named
    relative to `folder`, and the files copied (relative to `folder`)."""
    copied: list[str] = []
    roots: list[Path] = []
    for named in config_code(cfg):
        entry, function = _loose_file(named.spec)
        if entry is None:
            continue
        root = entry.parent
        roots += [root] if root not in roots else []
        into = CODE if roots.index(root) == 0 else f"{CODE}-{roots.index(root) + 1}"
        for file in local_files(entry):
            rel = Path(into) / file.relative_to(root)
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, folder / rel)
            copied += [rel.as_posix()] if rel.as_posix() not in copied else []
        cfg = _with(cfg, named.key, f"{into}/{entry.name}:{function}")
    return cfg, copied


def resolved(cfg: RunConfig, folder: Path) -> RunConfig:
    """`cfg` (an export's) with each factory named relative to the export made absolute within
    `folder`; a name that leads out of the folder is refused."""
    for named in config_code(cfg):
        file, _, function = named.spec.rpartition(":")
        if not file.endswith(".py") or Path(file).is_absolute():
            continue
        path = Path(os.path.normpath(folder.resolve() / file))
        if not path.is_relative_to(folder.resolve()):
            raise CheckpointError(
                f"load_model: {named.key} {named.spec!r} in {folder / META} names a file outside "
                "the folder; an export's code is named relative to it, inside it"
            )
        cfg = _with(cfg, named.key, f"{path}:{function}")
    return cfg


def card_note(copied: list[str]) -> str:
    """The model card's word on the code carried, or nothing where none is."""
    if not copied:
        return ""
    files = "".join(f"- `{name}`\n" for name in copied)
    return (
        "\n## Code\n\nThe task's code travels with the weights, named relative to this folder:\n\n"
        f"{files}\n`qgtrain.load_model(folder, trust_code=True)` and `qgtrain eval folder "
        "--trust-code`\nbuild the model from these copies, wherever the folder is. Read them "
        "first:\ntrust_code says you did.\n"
    )


def local_files(entry: Path) -> list[Path]:
    """`entry` and every module of its folder tree that it imports, directly or through another."""
    root = entry.parent
    found: list[Path] = []
    todo = [entry]
    while todo:
        file = todo.pop()
        if file not in found:
            found.append(file)
            todo += [f for f in _imported(file, root) if f not in found]
    return found


def _imported(file: Path, root: Path) -> list[Path]:
    """The files of `root`'s tree that the import statements of `file` name."""
    try:
        tree = ast.parse(file.read_text(), str(file))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []  # importing it fails the same way, in one line (factory.py)
    names: list[tuple[Path, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(root, alias.name.split(".")) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level <= len(file.parents):
            base = root if not node.level else file.parents[node.level - 1]
            parts = node.module.split(".") if node.module else []
            names += [(base, parts)] + [(base, [*parts, a.name]) for a in node.names]
    files: list[Path] = []
    for base, parts in names:
        for end in range(1, len(parts) + 1):
            files += _module_file(base.joinpath(*parts[:end]), root)
    return files


def _module_file(path: Path, root: Path) -> list[Path]:
    """The file a module at `path` is (a package's __init__.py, or a .py), inside `root`'s tree."""
    if not Path(os.path.normpath(path)).is_relative_to(root):
        return []
    for candidate in (path / "__init__.py", path.with_name(f"{path.name}.py")):
        if candidate.is_file():
            return [Path(os.path.normpath(candidate))]
    return []


def _loose_file(spec: str) -> tuple[Path | None, str]:
    """The file a factory names and its function: a 'file.py:function', or a top-level module
    that is a file outside every installed environment; None for anything else."""
    name, _, function = spec.rpartition(":")
    if name.endswith(".py"):
        path = Path(name).resolve()
        return (path if path.is_file() else None), function
    if "." in name:
        return None, function
    try:
        found = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None, function
    if found is None or not found.origin or not found.origin.endswith(".py"):
        return None, function  # not found, built in, or compiled
    origin = Path(found.origin).resolve()
    loose = origin.name != "__init__.py" and not _installed(origin)
    return (origin if loose else None), function


def _installed(path: Path) -> bool:
    places = {sysconfig.get_path(key) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    return any(part in ("site-packages", "dist-packages") for part in path.parts) or any(
        path.resolve().is_relative_to(Path(place).resolve()) for place in places if place
    )


def _with(cfg: RunConfig, key: str, spec: str) -> RunConfig:
    section, _, name = key.partition(".")
    changed = dataclasses.replace(getattr(cfg, section), **{name: spec})
    return dataclasses.replace(cfg, **{section: changed})
