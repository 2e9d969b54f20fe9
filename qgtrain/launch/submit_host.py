"""What the machine a job is submitted from gives the job: Slurm's commands, checked before anything
is written; the interpreter that submitted it, which the job runs unless told otherwise; and the
folder it was submitted from, which the job runs in.

A node's `python3` often lacks torch, while the submitting interpreter has just run qgtrain (and
verifies the snapshot): the job runs that one. Slurm's absence is found before anything is written,
so a submit from a laptop leaves no snapshot or run folder behind. No torch here.
"""

from __future__ import annotations

import os
import shutil
import sys

from ..foundation.errors import QgtrainError


def submitting_python() -> str:
    """This interpreter, as an absolute path the job's script names. Not resolved through links: a
    venv's `bin/python` is a link to the base interpreter, and the link's own place is what makes
    Python use the venv (its torch); python3 where Python cannot say which binary it runs."""
    return os.path.abspath(sys.executable) if sys.executable else "python3"


def require_slurm(*commands: str) -> None:
    """Refuse to submit where Slurm's `commands` (sbatch; submitit's executor needs srun too) are
    not on PATH: one line and exit 2, before a snapshot, run folder or submitit folder is made."""
    for command in commands or ("sbatch",):
        if shutil.which(command) is None:
            raise QgtrainError(
                f"submit: no Slurm here ({command} is not on PATH); nothing was submitted or "
                "written. HINT: run `qgtrain train` to train here, or submit from a login node"
            )


def snapshot_first(python: str, copy: str, indent: str = "") -> str:
    """Shell lines for a job that runs in the folder it was submitted from (relative paths mean
    what they meant there) with its snapshot first on PYTHONPATH: PYTHONSAFEPATH keeps Python
    3.11+ from putting that folder first on sys.path, ahead of the snapshot, under `python -m`. A
    Python without it (3.10) would import the live task module, so that job runs in the snapshot's
    copy of the folder (`copy`, a shell word) instead, saying so. No bytecode is written: a
    process that may write into the snapshot (root may, whatever its modes) would change the files
    it is sealed by, and the next start would refuse it. `python`: a shell word too."""
    check = "import sys; sys.exit(not getattr(sys.flags, 'safe_path', 0))"
    return (
        f"{indent}export PYTHONSAFEPATH=1  # the folder's modules never shadow the snapshot's\n"
        f"{indent}export PYTHONDONTWRITEBYTECODE=1  # nothing written into the sealed snapshot\n"
        f'{indent}{python} -c "{check}" || {{\n'
        f'{indent}    echo "qgtrain: this Python puts $PWD first on sys.path; the job runs in its '
        'snapshot copy" >&2\n'
        f"{indent}    cd {copy} || exit 1; }}\n"
    )
