"""Which of the submit directory's files the code snapshot leaves out, and why: those that may hold
a credential, and those slurm.snapshot_exclude names.

The snapshot lands in the run directory, which a group project shares and which outlives the job,
and git's idea of "not ignored" (or, without git, a file's suffix) says nothing about whether a file
is a key: an `.env` with an `HF_TOKEN`, a `deploy_key`, a `kaggle.json` are all plain untracked
files. So a file whose name looks like a credential's never reaches the copy, nor one whose text
holds a token of a form services issue (Hugging Face, OpenAI-style, AWS, GitHub, Slack) or a private
key block, whatever it is called: an `env.sh` exporting `HF_TOKEN=hf_...` is as much a secret as an
`.env`. A job needs none of them from the snapshot: a secret a job needs comes from its environment
or from a path outside the submit directory. Python modules are exempt from the names (a
`secrets.py` or `tokens.py` is code the job imports, and leaving it out would break the job on its
first import), not from their text: a token written into code is still a token. The token forms are
anchored on word boundaries and their issuers' prefixes, so code that merely mentions them
(`sk_learn`, `task-`, `HF_TOKEN`) stays. What is named at submit is the file and the kind of token,
never the token. No torch here.
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
    "*token*",
    "*api_key*",
    "*api-key*",
    "*apikey*",
    "kaggle.json",
    "*service-account*.json",
    ".netrc",
    ".pypirc",
    ".npmrc",
    "*.p12",
    "*.pfx",
)
# A tokenizer's files (tokenizer.json, tokenizer_config.json) are what a model reads, not tokens.
NOT_SECRET_NAMES = ("*tokeniz*", "*tokenis*")
# Each form a token is issued in, and what it is called when a file is left out for holding one.
# A pattern begins with its issuer's prefix, which the regex engine finds as plain text (fast); a
# token's counts only where it starts a word (_found).
_FORMS = (
    (rb"hf_[A-Za-z0-9]{30,}\b", "a Hugging Face token"),
    # sk-, sk-proj-, sk-ant-...: with a digit somewhere, so a kebab-case name is no key
    (rb"sk-(?=[A-Za-z0-9_-]*[0-9])[A-Za-z0-9_-]{20,}(?![A-Za-z0-9_-])", "an OpenAI-style API key"),
    (rb"A[KS]IA[A-Z0-9]{16}\b", "an AWS access key id"),
    (rb"gh[opsur]_[A-Za-z0-9]{36}\b", "a GitHub token"),
    (rb"github_pat_[A-Za-z0-9_]{22,}\b", "a GitHub token"),
    (rb"xox[abpors]-(?=[A-Za-z0-9-]*[0-9])[A-Za-z0-9-]{10,}", "a Slack token"),
    # PEM's armour of a private key of any kind (RSA, EC, OPENSSH, ENCRYPTED, PGP ... BLOCK)
    (rb"-----BEGIN [A-Z0-9 ]{0,40}PRIVATE KEY[A-Z ]{0,10}-----", "a private key"),
)
_PATTERNS = tuple((re.compile(pattern), kind) for pattern, kind in _FORMS)
_CHUNK = 1 << 20
# Longer than any token or armour line, so one cut between two reads is whole in the second; the
# byte before it is kept too, for the word boundary a token starts at.
_OVERLAP = 1024


def why_left_out(relative: str, path: Path, exclude: tuple[str, ...]) -> str | None:
    """Why the file at `path` (`relative` to the submit directory, with '/') stays out of the
    snapshot, in words for the line submit prints, or None when it is copied. `exclude`:
    slurm.snapshot_exclude's glob patterns, matched with the whole relative name and with each
    part of it."""
    parts = relative.split("/")
    name = parts[-1].lower()
    if not name.endswith(".py") and secret_name(name):
        return "named like a credential"
    if any(
        fnmatchcase(relative, pattern) or any(fnmatchcase(part, pattern) for part in parts)
        for pattern in exclude
    ):
        return "slurm.snapshot_exclude names it"
    found = None if path.is_symlink() else secret_in(path)
    return f"holds what looks like {found}" if found else None


def secret_name(name: str) -> bool:
    """Whether a lower-cased file name is one credentials are kept under."""
    return any(fnmatchcase(name, pattern) for pattern in SECRET_NAMES) and not any(
        fnmatchcase(name, pattern) for pattern in NOT_SECRET_NAMES
    )


def secret_in(path: Path) -> str | None:
    """What kind of token or key the file holds ("a Hugging Face token"), or None: read in pieces
    that overlap, so a large file is never held whole and a token across two pieces is found."""
    try:
        with path.open("rb") as handle:
            tail = b""
            while piece := handle.read(_CHUNK):
                held = tail + piece
                if kind := _kind(held, 1 if tail else 0):
                    return kind
                tail = held[-_OVERLAP - 1 :]
    except OSError:
        return None  # unreadable: the copy that follows says so
    return None


def secret_in_text(text: bytes) -> str | None:
    """What kind of token or key `text` (held already: git's diff) holds, or None."""
    return _kind(text, 0)


def _kind(held: bytes, start: int) -> str | None:
    return next((kind for pattern, kind in _PATTERNS if _found(pattern, held, start)), None)


def _found(pattern: re.Pattern[bytes], held: bytes, start: int) -> bool:
    """Whether `pattern` matches in `held` from `start`, a token's prefix not continuing a word
    (`myhf_...`, `task-...`: a longer word, no token); a key's armour may follow anything."""
    while match := pattern.search(held, start):
        at = match.start()
        if at == 0 or not (_word(held[at]) and _word(held[at - 1])):
            return True
        start = at + 1
    return False


def _word(byte: int) -> bool:
    return chr(byte).isascii() and (chr(byte).isalnum() or byte == ord("_"))
