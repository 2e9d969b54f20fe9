"""Which frames of a failure are the user's own code, so that an exception their task raised is told
as theirs, in one line naming their function, instead of a traceback that reads like qgtrain's.

The user's code is what the traceback passes through outside qgtrain, Python's standard library
and the installed packages (torch, transformers, datasets, ...): a task module, a model, a loss,
wherever it lives (a folder on PYTHONPATH, a job's code snapshot, a file named as
path/to/file.py:function).
"""

from __future__ import annotations

import os
import sysconfig
import traceback
from pathlib import Path

# the qgtrain that runs (a job's snapshot holds its own copy), and the interpreter's own library
_NOT_THEIRS = tuple(
    os.path.realpath(folder) + os.sep
    for folder in {
        str(Path(__file__).parents[1]),
        sysconfig.get_paths()["stdlib"],
        sysconfig.get_paths()["platstdlib"],
    }
)
_INSTALLED = {"site-packages", "dist-packages"}


def raised_in_users_code(exc: BaseException) -> str | None:
    """Where the user's code raised `exc`: the first function of theirs the traceback passes through
    (the one qgtrain called: a task function, loss, metrics, collate, a model factory), by its
    qualified name and the file:line of its definition, then the line of theirs the exception came
    out of. None where no frame is theirs: a failure of qgtrain or a library, told by its
    traceback."""
    theirs = [
        (frame.f_code, line)
        for frame, line in traceback.walk_tb(exc.__traceback__)
        if not frame.f_code.co_filename.startswith("<")
        and not (path := os.path.realpath(frame.f_code.co_filename)).startswith(_NOT_THEIRS)
        and not _INSTALLED & set(Path(path).parts)
    ]
    if not theirs:
        return None
    (called, _), (inner, line) = theirs[0], theirs[-1]
    name = getattr(called, "co_qualname", called.co_name)
    same = inner.co_filename == called.co_filename
    at = f"line {line}" if same else f"{inner.co_filename}:{line}"
    return f"{name} ({called.co_filename}:{called.co_firstlineno}), at {at}"
