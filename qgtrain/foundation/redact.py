"""Credentials kept out of what qgtrain logs and prints: Slurm output files and run logs sit on
shared filesystems and get pasted into bug reports, so a tracker's password or token must never
reach them.

A URI's password (`scheme://user:password@host`), a user name alone (`https://TOKEN@host`: services
put tokens there) and the values of query parameters named like a secret (token, key, password, ...)
become '***'; a setting whose name says it is a secret (WANDB_API_KEY) is shown as '***' whole.
Everything else is shown as it is: what a user needs to see which server was used.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlsplit

MASK = "***"
_SECRET_NAME = re.compile(r"pass|secret|token|key|auth|credential|sig", re.IGNORECASE)
_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)(?:([^\s/@:]*):)?[^\s/@]*@")
_QUERY_SECRET = re.compile(
    r"([?&;][^\s=&;#]*(?:pass|secret|token|key|auth|credential|sig)"
    r"[^\s=&;#]*=)[^\s&;#]*",
    re.IGNORECASE,
)


def secret_name(name: str) -> bool:
    """Whether a variable or parameter name says its value is a secret (WANDB_API_KEY,
    access_token)."""
    return bool(_SECRET_NAME.search(name))


def uri_credentials(uri: str) -> str | None:
    """What in `uri` is a credential (userinfo, or a query parameter named like a secret), or
    None."""
    try:
        parts = urlsplit(uri)
    except ValueError:  # not a URI urllib can split: judge its text
        return "a credential" if mask_text(uri) != uri else None
    if "@" in parts.netloc:
        userinfo = parts.netloc.rpartition("@")[0]
        return "a user name and password" if ":" in userinfo else "a user name"
    for name, _ in parse_qsl(parts.query, keep_blank_values=True):
        if secret_name(name):
            return f"the query parameter {name!r}"
    return None


def mask_text(text: str) -> str:
    """`text` with every URI password and secret query value in it replaced by MASK (for messages of
    libraries, which may quote the URI they failed on)."""

    def userinfo(match: re.Match[str]) -> str:
        return f"{match[1]}{match[2]}:{MASK}@" if match[2] is not None else f"{match[1]}{MASK}@"

    return _QUERY_SECRET.sub(rf"\1{MASK}", _USERINFO.sub(userinfo, text))


def mask_setting(name: str, value: str) -> str:
    """A setting as it may be shown: MASK for a secret's name, else its value with credentials
    masked."""
    return MASK if secret_name(name) else mask_text(value)
