"""What every section's fields are made of: a default with its documentation and bounds, read by the
loader (load.py) to validate a file and explain a mistake, and by tests/test_config.py to hold
config.yaml's comments to the same words."""

from __future__ import annotations

import re
from dataclasses import field
from typing import Any

# a week: longer than any job's time limit, within what timers can hold
MAX_TIMEOUT_S = 7 * 24 * 3600.0

# A section's rule returns the first key it finds wrong and what to do about it, or None.
Problem = tuple[str, str] | None


def setting(default: Any, doc: str, *, min: float | None = None, max: float | None = None) -> Any:
    """A config field with its documentation and numeric bounds (inclusive)."""
    metadata = {"doc": doc, "min": min, "max": max}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def name_problem(where: str, kind: str, name: object, seen: set[str]) -> Problem:
    """A name that keys metrics (a mix source's samples_<name>, a task's eval_<name>_<metric>):
    letters, digits, _ . -, and each once among `seen` (which it joins)."""
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        return f"{where}.name", f"{name!r} is not a name of letters, digits, _ . -"
    if name in seen:
        return f"{where}.name", f"{kind} {name!r} is named twice; each name once"
    seen.add(name)
    return None


def files_problem(where: str, owner: str, files: object, what: str) -> Problem:
    """A `files` setting (a mix source's, a task's): one string or a non-empty list of them, where
    `what` says which strings are meant."""
    listed = [files] if isinstance(files, str) else files
    if not isinstance(listed, list) or not listed or not all(isinstance(f, str) for f in listed):
        return f"{where}.files", f"{owner}: expected a non-empty list of {what}"
    return None


def factory_problem(key: str, value: str | None) -> Problem:
    """A 'package.module:function' (or 'path/to/file.py:function') setting of the wrong form."""
    if value and (value.count(":") != 1 or not all(value.split(":"))):
        return key, (
            f"'{value}' is not of the form 'package.module:function' or 'path/to/file.py:function'"
        )
    return None
