"""Every slurm: value that reaches a batch script or sbatch, checked against what Slurm accepts:
a value Slurm would misread, or one that could break out of its line, is refused with the key, the
value and what is allowed. No torch here.
"""

from __future__ import annotations

import math
import re

from ..config import SlurmConfig
from ..foundation.durations import slurm_time_s
from ..foundation.errors import QgtrainError

_PATTERNS = {
    "job_name": (r"[A-Za-z0-9_.+-]+", "letters, digits and _ . + -"),
    "partition": (r"[A-Za-z0-9_.,-]*", "letters, digits and _ . , -"),
    "account": (r"[A-Za-z0-9_.-]*", "letters, digits and _ . -"),
    "qos": (r"[A-Za-z0-9_.-]*", "letters, digits and _ . -"),
    "constraint": (r"[A-Za-z0-9_.,&|\[\]*:()-]*", "feature names joined by & | , with [ ] ( ) * :"),
    "mem": (r"(\d+[KMGT]?)?", "a number with an optional K, M, G or T suffix, e.g. 64G"),
    "output_dir": (r"[A-Za-z0-9_./+-]+", "a path of letters, digits and _ . / + -"),
    "container_image": (
        r"[A-Za-z0-9_.:/#@+-]*",
        "an image name, URI or path of letters, digits and _ . : / # @ + -",
    ),
    "apptainer_image": (
        r"[A-Za-z0-9_.:/#@+-]*",
        "an image name, URI or path of letters, digits and _ . : / # @ + -",
    ),
}
_EXTRA = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(=[A-Za-z0-9_.,:=/@%+\[\]-]+)?")
_MOUNT = re.compile(r"[A-Za-z0-9_./+@-]+(:[A-Za-z0-9_./+@-]+(:[A-Za-z+]+)?)?")


def time_minutes(text: str) -> int:
    """Slurm's time formats (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) in whole minutes, rounded up."""
    seconds = slurm_time_s(text)
    if seconds is None:
        raise QgtrainError(
            f"slurm.time: {text!r} is not a Slurm time; use minutes, HH:MM:SS or D-HH:MM:SS"
        )
    if seconds < 1:
        raise QgtrainError(f"slurm.time: {text!r} is shorter than one minute")
    return math.ceil(seconds / 60)


def validate(slurm: SlurmConfig) -> None:
    """Refuse any value Slurm would misread or that could break out of its line."""
    for key, (pattern, allowed) in _PATTERNS.items():
        value = getattr(slurm, key)
        if not re.fullmatch(pattern, value):
            raise QgtrainError(f"slurm.{key}: {value!r} is not allowed; use {allowed}")
    time_minutes(slurm.time)
    if slurm.signal_lead_s >= time_minutes(slurm.time) * 60:
        raise QgtrainError(
            f"slurm.signal_lead_s: {slurm.signal_lead_s}s is not shorter than slurm.time "
            f"({slurm.time}); the warning signal would come before the job starts"
        )
    for line in slurm.extra_sbatch:
        if not _EXTRA.fullmatch(line):
            raise QgtrainError(
                f"slurm.extra_sbatch: {line!r} is not allowed; use sbatch options such as "
                "'--exclusive' or '--reservation=name' (letters, digits and _ . , : = / @ % + - )"
            )
    for line in slurm.setup:
        if "\n" in line or "\r" in line:
            raise QgtrainError(
                f"slurm.setup: {line!r} holds a line break; give one list item per line"
            )
    _validate_container(slurm)


def _validate_container(slurm: SlurmConfig) -> None:
    if slurm.container_image and slurm.apptainer_image:
        raise QgtrainError(
            "slurm.apptainer_image: set together with slurm.container_image; choose one: pyxis "
            "(container_image) or apptainer (apptainer_image)"
        )
    for mount in slurm.container_mounts:
        if not _MOUNT.fullmatch(mount):
            raise QgtrainError(
                f"slurm.container_mounts: {mount!r} is not allowed; use SRC:DST or SRC:DST:FLAGS, "
                "paths of letters, digits and _ . / + @ -, one mount per list item"
            )
    if slurm.container_mounts and not (slurm.container_image or slurm.apptainer_image):
        raise QgtrainError(
            "slurm.container_mounts: there is no container to mount into; set "
            "slurm.container_image (pyxis) or slurm.apptainer_image"
        )
