"""torch.compile's caches kept in the run directory, so a requeued job does not compile everything
again.

Inductor and Triton cache compiled kernels under /tmp by default: node-local, often wiped, and a
requeued job usually lands on another node, where it compiled from scratch (most of its start:
bench.compile_restart measures it). With model.compile each rank keeps its cache in <run
dir>/compile-cache/rank-N, on the shared filesystem, where the next start of the same rank finds it.
torch's portable cache artifacts (save/load_cache_artifacts) were measured too: on the CPU they
carry the graphs but not the compiled C++, and saved little of the start.

The folder is offered for the whole training (`in_run_dir`) but taken only when something is
compiled (`claim`, from training/parallel/compiling.py): with `model.compile: auto` a CPU run
compiles nothing, and should neither make the folder nor import inductor's utilities (a second of
start).

A cache is code: inductor imports the Python it generated there, as the user. The start's checks
(rundir.require_safe) make sure only the user wrote it; `claim` also makes sure it was made in this
very run folder. `compile-cache/rank-N.json` records the folder's device and inode and the run id;
a cache without a matching record (a run copied with `cp -r` from a colleague's, whose files are
all the user's now; a folder put in place of the run's) is removed unread and compiled afresh.
The device is compared only on the host that wrote the record: a shared filesystem numbers its
device per node, and a requeued rank lands on another node.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..foundation.files import temp_name, write_atomic
from ..foundation.pinned import Pinned

log = logging.getLogger("qgtrain")


class _Offer:
    def __init__(
        self, folder: Path, undo: contextlib.ExitStack, pin: Pinned | None, run_id: str
    ) -> None:
        self.folder, self.undo, self.claimed = folder, undo, False
        self.pin, self.run_id = pin, run_id


# the folders offered by the enclosing in_run_dir blocks, innermost last
_offered: list[_Offer] = []


@contextlib.contextmanager
def in_run_dir(
    run_dir: Path, rank: int, pin: Pinned | None = None, run_id: str = ""
) -> Iterator[Path]:
    """Offer <run dir>/compile-cache/rank-<rank> to whatever compiles within the block; with `pin`
    (the run folder checked at start) and `run_id`, only a cache made in that folder is used."""
    folder = run_dir / "compile-cache" / f"rank-{rank}"
    with contextlib.ExitStack() as undo:
        offer = _Offer(folder, undo, pin, run_id)
        _offered.append(offer)
        try:
            yield folder
        finally:
            _offered.remove(offer)


def claim() -> Path | None:
    """Point inductor's caches at the offered folder (once; None where none is offered), once the
    run folder is the one checked at start and the cache is bound to it: nothing of the cache is
    read before."""
    if not _offered:
        return None
    offer = _offered[-1]
    if not offer.claimed:
        if offer.pin is not None:
            offer.pin.check()
            bind(offer.folder, record(offer.pin, offer.run_id))
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        offer.folder.mkdir(parents=True, exist_ok=True)
        offer.undo.enter_context(temporary_cache_dir(str(offer.folder)))
        offer.claimed = True
        log.info("torch.compile caches in %s, for the next start of this rank", offer.folder)
    return offer.folder


def record(pin: Pinned, run_id: str) -> dict[str, Any]:
    """What binds a cache to its run folder."""
    host = socket.gethostname()
    return {"run_id": run_id, "device": pin.device, "inode": pin.inode, "host": host}


def bind(folder: Path, mine: dict[str, Any]) -> None:
    """Remove `folder` unread unless its record is `mine` (one line says why), then record
    `mine`: a cache made elsewhere is never loaded."""
    marker = folder.with_name(f"{folder.name}.json")
    if os.path.lexists(folder) and (why := _mismatch(_read(marker), mine)):
        aside = temp_name(folder)  # the name is free at once; the files go after
        os.rename(folder, aside)
        shutil.rmtree(aside, ignore_errors=True)
        log.warning(
            "the compile cache %s %s (a copied run, or a folder put in place of this one): "
            "removed it unread; compiling afresh",
            folder,
            why,
        )
    marker.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(marker, json.dumps(mine), 0o600)


def _mismatch(found: dict[str, Any] | None, mine: dict[str, Any]) -> str | None:
    if found is None:
        return "has no record of the run folder it was made in"
    if found.get("run_id") != mine["run_id"]:
        return f"was made for run {found.get('run_id')!r}, not {mine['run_id']!r}"
    same_host = found.get("host") == mine["host"]
    if found.get("inode") != mine["inode"] or same_host and found.get("device") != mine["device"]:
        return "was made in another folder than this run's"
    return None


def _read(marker: Path) -> dict[str, Any] | None:
    """The record, read only from a plain file (never through a link, never waiting on a FIFO)."""
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        found = json.loads(os.read(fd, 4096))
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    return found if isinstance(found, dict) else None
