"""The on-disk checkpoint format: files written in a staging folder, committed by one atomic rename.

    checkpoints/step-<N>/                 committed: manifest.json lists every file with its
                                          size and xxh3 checksum
    checkpoints/.tmp-step-<N>-<run id>/   being written; never counts, removed when found stale

(layout.py names every file of a checkpoint.)

A folder counts as a checkpoint only if its manifest (written last, then the rename) parses and
names this format. Before a checkpoint is used its files are checked against the manifest, so a
truncated or corrupted file is reported by name and the previous checkpoint is used instead. Files
are torch.save'd and loaded with weights_only=True, so loading never runs code from a file; a
manifest's names count only inside the folder (manifest_files.py), and DCP's metadata only as its
own classes (dcp_safe.py). This module knows nothing of ranks; checkpointer.py decides who writes
what.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..foundation.errors import CheckpointError, first_line
from . import layout
from . import manifest_files as listed
from .layout import MANIFEST as MANIFEST  # the manifest is this module's; its name, layout's
from .layout import SHARDED_METADATA

FORMAT = "qgtrain-checkpoint-1"


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    run_id: str
    val_loss: float | None
    manifest: dict[str, Any]

    @property
    def score(self) -> float | None:
        """How good this checkpoint is by the run's early_stopping.metric, lower being better;
        checkpoints written without a validation have none. Older manifests recorded only
        val_loss."""
        score = self.manifest.get("score")
        if isinstance(score, dict) and isinstance(score.get("value"), (int, float)):
            return float(score["value"]) * (-1.0 if score.get("mode") == "max" else 1.0)
        return None if "score" in self.manifest else self.val_loss

    def metric(self, name: str) -> float | None:
        """The value of a validation or downstream metric (val_loss, eval_qa_acc, ...) at this
        checkpoint, where it ended a validation; none for one without."""
        value = (self.manifest.get("metrics") or {}).get(name)
        return float(value) if isinstance(value, (int, float)) else None


def staging_dir(root: Path, step: int, run_id: str) -> Path:
    return root / layout.staging_folder(step, run_id)


def write_files(folder: Path, files: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Write each object (torch.save, or bytes as they are) and return manifest entries (size,
    checksum).

    torch.save writes through its own C++ path; each finished file is hashed from the page cache in
    a thread while the next one is written, so checksums add almost nothing. Nothing is fsynced
    here: `make_durable` does that after the commit, off the training path.
    """
    # here, not at the top: `qgtrain runs` reads manifests on login nodes without torch
    import torch

    with ThreadPoolExecutor(max_workers=2) as pool:
        digests = {}
        for name, obj in files.items():
            if isinstance(obj, bytes):
                (folder / name).write_bytes(obj)
            else:
                torch.save(obj, folder / name)
            digests[name] = pool.submit(listed.digest, folder / name)
        return {
            name: {"size": (folder / name).stat().st_size, "xxh3": future.result()}
            for name, future in digests.items()
        }


def explain_write_error(exc: BaseException, staging: Path, files: dict[str, Any]) -> str:
    """Why a write failed, in the user's terms: a full disk says how much room there is and is
    needed."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else first_line(exc, 200)
    try:
        # freed when the staging folder goes
        written = sum(p.stat().st_size for p in staging.iterdir())
        free = shutil.disk_usage(staging.parent).free + written
    except OSError:
        return text
    needed = _nbytes(files)
    if getattr(exc, "errno", None) == errno.ENOSPC or "No space left" in text or free < needed:
        return (
            f"no space left on the filesystem of {staging.parent}: {free / 1e6:.1f} MB free, the "
            f"checkpoint needs about {needed / 1e6:.1f} MB"
        )
    return text


def _nbytes(obj: Any) -> int:
    if isinstance(obj, bytes):
        return len(obj)
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return int(obj.element_size() * obj.numel())
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


def file_entry(path: Path) -> dict[str, Any]:
    """A file's manifest entry, for files written by others (torch.distributed.checkpoint)."""
    return {"size": path.stat().st_size, "xxh3": listed.digest(path)}


def commit(staging: Path, final: Path, files: dict[str, Any], meta: dict[str, Any]) -> Checkpoint:
    """Write the manifest last and rename the staging folder into place."""
    manifest = {"format": FORMAT, **meta, "files": files, "committed_at": time.time()}
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
    if final.exists():
        _set_aside(final, manifest["run_id"])
    os.rename(staging, final)
    return Checkpoint(
        final, manifest["step"], manifest["run_id"], manifest.get("val_loss"), manifest
    )


def make_durable(folder: Path, names: list[str]) -> list[str]:
    """fsync the named files, then the folder and its parent. Returns what could not be synced.

    Until this returns, a power loss may leave the newest checkpoint torn; its checksums then fail
    and the previous one (made durable before this one was written) is used.
    """
    failed = []
    for name in names:
        try:
            fd = os.open(folder / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            failed.append(f"{folder / name}: {exc.strerror or exc}")
    for inside in sorted({(folder / name).parent for name in names} - {folder}):  # sharded/
        _fsync_dir(inside)
    _fsync_dir(folder)
    _fsync_dir(folder.parent)
    return failed


def _set_aside(existing: Path, run_id: str) -> None:
    """A folder already holds this step: ours from an earlier attempt is replaced, another run's is
    kept."""
    old = read_manifest(existing)
    if old is not None and old.run_id != run_id:
        os.rename(existing, existing.with_name(f"{existing.name}.from-run-{old.run_id}"))
        return
    doomed = existing.with_name(f"{layout.REPLACED_PREFIX}{existing.name}-{os.getpid()}")
    os.rename(existing, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def read_manifest(folder: Path) -> Checkpoint | None:
    """The checkpoint in `folder` if its manifest is complete, else None."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        if manifest.get("format") != FORMAT:
            return None
        return Checkpoint(
            folder,
            int(manifest["step"]),
            str(manifest["run_id"]),
            manifest.get("val_loss"),
            manifest,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def list_committed(root: Path) -> list[Checkpoint]:
    """Committed checkpoints under root (any run), ordered by step number."""
    found = [read_manifest(entry) for entry in _step_folders(root)]
    return sorted((c for c in found if c is not None), key=lambda c: c.step)


def list_unreadable(root: Path) -> list[Path]:
    """Folders named like a committed checkpoint whose manifest is missing or damaged.

    A commit renames a folder into place only after its manifest is written, so such a folder was
    damaged afterwards (a manifest deleted by hand, a torn copy): it is reported, never used.
    """
    return sorted(
        (entry for entry in _step_folders(root) if read_manifest(entry) is None),
        key=lambda p: int(p.name.split("-")[1]),
    )


def _step_folders(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [
        entry
        for entry in root.iterdir()
        if layout.STEP_PATTERN.fullmatch(entry.name) and entry.is_dir()
    ]


def verify(
    ckpt: Checkpoint, names: list[str] | None = None, *, checksums: bool = True
) -> str | None:
    """None if every file (or the named ones) matches its manifest entry, else what is wrong, naming
    the file. Without `checksums` only sizes are compared: a stat per file, no reading. With them, a
    sharded checkpoint's `.metadata` must also hold nothing that would run code (dcp_safe.py)."""
    try:  # names that leave the folder, then links, FIFOs and devices in it, listed or not
        problem = listed.listing_problem(
            ckpt.manifest, ckpt.path / MANIFEST
        ) or listed.stray_problem(ckpt.path)
    except OSError as exc:
        problem = f"{ckpt.path} cannot be read ({exc.strerror or exc})"
    if problem:
        return problem
    files = ckpt.manifest.get("files", {})
    for name in files if names is None else names:
        path, entry = ckpt.path / name, files[name]
        try:
            size = listed.regular_file(ckpt.path, name).st_size
            if size != entry["size"]:
                return (
                    f"{path} has {size} bytes, the manifest says {entry['size']} "
                    "(truncated or overwritten)"
                )
            digest = listed.digest(path) if checksums else entry["xxh3"]
        except listed.UnsafeFile as exc:
            return f"{exc}, which a checkpoint's manifest may not list"
        except OSError as exc:
            return f"{path} cannot be read ({exc.strerror or exc})"
        if digest != entry["xxh3"]:
            return f"{path} does not match its checksum in {ckpt.path / MANIFEST} (corrupted)"
    if checksums and SHARDED_METADATA in (files if names is None else names):
        from .dcp_safe import metadata_problem  # torch: only where a sharded checkpoint is checked

        return metadata_problem(ckpt)
    return None


def load_file(ckpt: Checkpoint, name: str) -> Any:
    """A torch-saved file of the checkpoint, on the CPU. Anything but tensors and plain containers
    (a pickle that would run code, a file from another program) is refused, not executed."""
    import torch

    path = ckpt.path / name
    try:
        listed.regular_file(ckpt.path, name)  # torch.load would wait forever on a FIFO
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing from the checkpoint") from None
    except (pickle.UnpicklingError, RuntimeError, ValueError, EOFError) as exc:
        raise CheckpointError(
            f"{path} cannot be loaded safely as tensors ({first_line(exc, 200)}); loading it "
            "would mean running code from the file, which qgtrain never does"
        ) from None


def load_json(ckpt: Checkpoint, name: str) -> Any:
    return json.loads(listed.read_regular(ckpt.path / name))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some network filesystems refuse fsync on a directory
        pass
    finally:
        os.close(fd)
