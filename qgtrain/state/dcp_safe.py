"""Reading a sharded checkpoint (torch.distributed.checkpoint, DCP) without running code from it.

DCP trusts its folder: FileSystemReader.read_metadata (torch/distributed/checkpoint/filesystem.py)
pickle.loads `.metadata`, and DefaultLoadPlanner.load_bytes (default_planner.py) torch.loads every
entry saved as bytes with weights_only=False. Checksums do not help, since whoever writes the files
writes the manifest. So `.metadata` is unpickled admitting only the classes DCP's metadata is made
of, every entry must point into a file the manifest lists, and bytes entries (qgtrain's are the
optimizer's param_groups: numbers, flags, names) load with weights_only=True. Anything else makes
the checkpoint damaged, naming what was refused: verification (checkpoint.verify) checks all of it,
so a start resumes from the checkpoint before; the loads check again as they read.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

from ..foundation.errors import CheckpointError, first_line
from .layout import SHARDED, SHARDED_METADATA
from .manifest_files import name_problem, open_regular, read_regular

if TYPE_CHECKING:  # checkpoint.py calls this module: the type alone, no cycle
    from .checkpoint import Checkpoint

_METADATA = (
    "Metadata",
    "MetadataIndex",
    "StorageMeta",
    "TensorStorageMetadata",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "TensorProperties",
    "_MEM_FORMAT_ENCODING",
)
# What a pickle of DCP's Metadata names (found on qgtrain's own fsdp checkpoints, torch 2.13): its
# dataclasses, torch.Size, dtypes and layouts (by name, or through torch.serialization._get_layout),
# and the path it was saved at; pathlib's classes live in pathlib._local from Python 3.13.
_ALLOWED = {
    *(("torch.distributed.checkpoint.metadata", name) for name in _METADATA),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    *(
        (module, name)
        for module in ("pathlib", "pathlib._local")
        for name in ("PosixPath", "PurePosixPath")
    ),
    *(
        ("torch", name)
        for name, value in vars(torch).items()
        if isinstance(value, (torch.dtype, torch.layout))
    ),
}
_GLOBAL = re.compile(r"GLOBAL (\S+)")  # how torch's weights_only unpickler names what it refused
# What unpickling damaged data raises: pickle's own errors, and those of the constructors it calls.
_DAMAGED = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    AttributeError,
    KeyError,
    IndexError,
    ImportError,
    RuntimeError,
    RecursionError,
)


class _Refused(Exception):
    """A class or function the metadata names that it may not."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED:
            raise _Refused(f"{module}.{name}")
        return super().find_class(module, name)


def read_metadata(ckpt: Checkpoint) -> Metadata:
    """The checkpoint's DCP metadata, unpickled admitting only DCP's own classes, every entry
    pointing into a file of sharded/ that the manifest lists; else a CheckpointError naming what
    was refused."""
    path = ckpt.path / SHARDED_METADATA
    raw = read_regular(path)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except _Refused as exc:
        raise CheckpointError(
            f"qgtrain refuses to unpickle {exc} from {path}: DCP metadata is "
            "made only of torch.distributed.checkpoint's own classes, and "
            "loading this would run code from the file"
        ) from None
    except _DAMAGED as exc:
        raise CheckpointError(
            f"{path} cannot be read as torch.distributed.checkpoint metadata "
            f"({type(exc).__name__}: {first_line(exc, 200)})"
        ) from None
    if not (
        isinstance(metadata, Metadata)
        and isinstance(metadata.state_dict_metadata, dict)
        and isinstance(metadata.storage_data, dict)
    ):
        raise CheckpointError(
            f"{path} holds a {type(metadata).__name__}, not the metadata of "
            "torch.distributed.checkpoint"
        )
    for index, info in metadata.storage_data.items():
        _check_entry(ckpt, getattr(index, "fqn", index), info)
    return metadata


def _check_entry(ckpt: Checkpoint, fqn: object, info: object) -> None:
    """An entry is a span of a listed file of sharded/, without stream transforms (qgtrain writes
    none): DCP opens it by the name the metadata gives, so that name must be one verified."""
    where = ckpt.path / SHARDED_METADATA
    if not isinstance(info, _StorageInfo):
        raise CheckpointError(f"{where} stores {fqn!r} as a {type(info).__name__}, not in a file")
    file, listed = info.relative_path, ckpt.manifest.get("files", {})
    if (
        not isinstance(file, str)
        or name_problem(file)
        or "/" in file
        or f"{SHARDED}/{file}" not in listed
    ):
        raise CheckpointError(
            f"{where} stores {fqn!r} in {file!r}, which is not a file of "
            f"{SHARDED}/ that the manifest lists"
        )
    offset, length = info.offset, info.length
    if not (type(offset) is int and type(length) is int and min(offset, length) >= 0):
        raise CheckpointError(f"{where} stores {fqn!r} at offset {offset!r}, length {length!r}")
    if info.transform_descriptors:
        raise CheckpointError(
            f"{where} stores {fqn!r} through stream transforms "
            f"{info.transform_descriptors!r}, which qgtrain never writes"
        )


def load_bytes_entry(raw: bytes, what: str) -> Any:
    """A value DCP saved as bytes (torch.save of a non-tensor), loaded with weights_only=True:
    numbers, strings, containers and tensors pass; a pickle naming any other global is refused, by
    name."""
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _GLOBAL.search(str(exc))
        refused = found.group(1) if found else "something other than plain data"
        raise CheckpointError(
            f"qgtrain refuses to unpickle {refused} from {what}: a value saved "
            "as bytes is loaded only as plain data, and loading this would run "
            "code from the file"
        ) from None
    except _DAMAGED as exc:  # a truncated or garbled entry
        raise CheckpointError(
            f"{what} cannot be loaded ({type(exc).__name__}: {first_line(exc, 200)})"
        ) from None


def metadata_problem(ckpt: Checkpoint) -> str | None:
    """What verification finds wrong with a sharded checkpoint's metadata or its bytes entries."""
    try:
        metadata = read_metadata(ckpt)
        for index, info in metadata.storage_data.items():
            if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                path = ckpt.path / SHARDED / info.relative_path
                load_bytes_entry(_span(path, info.offset, info.length), f"{path} ({index.fqn})")
    except CheckpointError as exc:
        return str(exc)
    except OSError as exc:
        return f"{ckpt.path / SHARDED} cannot be read ({exc.strerror or exc})"
    return None


def _span(path: Path, offset: int, length: int) -> bytes:
    fd = open_regular(path)
    try:
        raw = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    if len(raw) != length:
        raise CheckpointError(
            f"{path} ends before the {length} bytes at {offset} that its metadata records"
        )
    return raw


class SafeReader(FileSystemReader):
    """DCP's reader of sharded/, its metadata read once by `read_metadata` above, not by pickle."""

    def __init__(self, ckpt: Checkpoint) -> None:
        super().__init__(ckpt.path / SHARDED)
        self._metadata = read_metadata(ckpt)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if getattr(self._metadata, "storage_meta", None) is None:  # as FileSystemReader's does
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return self._metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, but a bytes entry loads with weights_only=True and never into a
    tensor's place (otherwise as DefaultLoadPlanner.load_bytes in default_planner.py)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        if isinstance(self.state_dict.get(fqn), torch.Tensor):
            raise CheckpointError(
                f"the sharded checkpoint saves {fqn} as pickled bytes where a tensor belongs"
            )
        loaded = load_bytes_entry(value.getvalue(), f"the sharded checkpoint's entry {fqn}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load(
    ckpt: Checkpoint,
    state: dict[str, Any],
    *,
    reader: SafeReader | None = None,
    no_dist: bool = False,
) -> None:
    """DCP's load of `state` in place through SafeReader and SafeLoadPlanner (a collective unless
    no_dist). A refusal inside DCP comes out as the CheckpointError it was, not wrapped by DCP."""
    try:
        dcp_load(
            state,
            storage_reader=reader or SafeReader(ckpt),
            planner=SafeLoadPlanner(),
            no_dist=no_dist,
        )
    except CheckpointException as exc:
        refused = [
            failure[0]
            for failure in exc.failures.values()
            if isinstance(failure[0], CheckpointError)
        ]
        if refused:
            raise refused[0] from None
        raise
