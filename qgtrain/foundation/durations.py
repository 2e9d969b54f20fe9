"""Durations as users write them: '3h30m', '45m', '90s', '1d2h' (train.max_time), and Slurm's own
forms (slurm.time, scontrol's limits). One parser for both, so a time means the same everywhere."""

from __future__ import annotations

import re

_UNITS = re.compile(r"(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?")
_SLURM = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def duration_s(text: str) -> float | None:
    """Seconds in '3h30m', '45m', '90s', '1d2h', or Slurm's forms (see slurm_time_s); None if the
    text is none of them or not positive."""
    units = _UNITS.fullmatch(text.strip())
    if not text.strip() or not units or not any(units.groups()):
        return slurm_time_s(text) or None
    days, hours, minutes, seconds = (int(g or 0) for g in units.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def slurm_time_s(text: str) -> float | None:
    """Seconds in a Slurm time (minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS), as sbatch
    --time reads it; None if the text is not one."""
    slurm = _SLURM.fullmatch(text.strip())
    if slurm is None:
        return None
    days_text, first, second, third = slurm.groups()
    if days_text is not None:
        days, hours, minutes, seconds = (
            int(days_text),
            int(first),
            int(second or 0),
            int(third or 0),
        )
    elif third is not None:
        days, hours, minutes, seconds = 0, int(first), int(second), int(third)
    else:
        days, hours, minutes, seconds = 0, 0, int(first), int(second or 0)
    total = ((days * 24 + hours) * 60 + minutes) * 60 + seconds
    return float(total) if total > 0 else None
