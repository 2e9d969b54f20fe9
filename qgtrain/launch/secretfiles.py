"""Which of the submit directory's files the code snapshot leaves out: those that may hold a
credential, and those slurm.snapshot_exclude names.

The snapshot lands in the run directory, which a group project shares and which outlives the job,
and git's idea of "not ignored" (or, without git, a file's suffix) says nothing about whether a file
is a key: an `.env` with an `HF_TOKEN`, a `deploy_key`, a `gcp-service-account.json` are all plain
untracked files. So a file whose name looks like a credential's, or that holds a private key block,
never reaches the copy. A job needs none of them from the snapshot: a secret a job needs comes from
its environment or from a path outside the submit directory. Python modules are exempt from the
names (a `secrets.py` or `credentials.py` is code the job imports, and leaving it out would break
the job on its first import), not from the key block. No torch here.
"""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from pathlib import Path

# Compared with the file's name, lower-cased.
SECRET_NAMES = (
    ".env*",
    "*.pem",
    "*.key",
    "*_key",
    "id_*",
    "*credential*",
    "*secret*",
    "*service-account*.json",
    ".netrc",
    ".pypirc",
    ".npmrc",
    "*.p12",
    "*.pfx",
)
# PEM's armour of a private key of any kind (RSA, EC, OPENSSH, ENCRYPTED, PGP ... BLOCK)
_PRIVATE_KEY = re.compile(rb"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY[A-Z ]{0,10}-----")
_CHUNK = 1 << 20
_OVERLAP = 80  # longer than any armour line, so a block cut between two reads is still found


def left_out(relative: str, path: Path, exclude: tuple[str, ...]) -> bool:
    """Whether the file at `path` (`relative` to the submit directory, with '/') stays out of the
    snapshot. `exclude`: slurm.snapshot_exclude's glob patterns, matched with the whole relative
    name and with each part of it."""
    parts = relative.split("/")
    name = parts[-1].lower()
    if not name.endswith(".py") and any(fnmatchcase(name, pattern) for pattern in SECRET_NAMES):
        return True
    if any(
        fnmatchcase(relative, pattern) or any(fnmatchcase(part, pattern) for part in parts)
        for pattern in exclude
    ):
        return True
    return not path.is_symlink() and holds_private_key(path)


def holds_private_key(path: Path) -> bool:
    """Whether the file holds a PEM private key block anywhere (read in pieces: a large file is
    never held whole)."""
    try:
        with path.open("rb") as handle:
            tail = b""
            while piece := handle.read(_CHUNK):
                if _PRIVATE_KEY.search(tail + piece):
                    return True
                tail = piece[-_OVERLAP:]
    except OSError:
        return False  # unreadable: the copy that follows says so
    return False
