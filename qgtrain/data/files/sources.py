"""A user's data files: found from globs, then read one document at a time, never a whole file at
once.

The format comes from the extension. A folder written by Hugging Face `datasets`' save_to_disk is
read with pyarrow, because that is what datasets stores (Arrow stream files listed in state.json);
reading it needs no `datasets` import. Every problem a user can fix names the file (and line), what
was found and what is allowed.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ...foundation.errors import ConfigError
from .columns import arrow_columns, column_texts, parquet_columns
from .opening import check_reached, check_regular, glob_root, open_regular, read_text

SUFFIXES = {
    ".txt": "text",
    ".md": "text",
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
ALLOWED = (
    ".txt, .md, .jsonl, .ndjson, .json (each also .gz), .parquet, .arrow, a save_to_disk folder"
)
# a long text file is read in pieces of about this size, split at line ends
TEXT_PIECE_BYTES = 1 << 20


@dataclass(frozen=True)
class SourceFile:
    """One file of text, and the identity that decides whether a cache made from it is still
    current."""

    path: str
    kind: str
    size: int
    mtime_ns: int

    def unchanged(self) -> bool:
        stat = os.stat(self.path)
        return (stat.st_size, stat.st_mtime_ns) == (self.size, self.mtime_ns)


@dataclass(frozen=True)
class Piece:
    """Text to tokenize. A document is one piece, or several (a long text file) of which the last
    ends it."""

    text: str
    document: int
    ends_document: bool


def find(patterns: Sequence[str], key: str) -> list[SourceFile]:
    """Every file the patterns name, in order (each glob sorted), each once. A file found by a glob
    or in a folder must be reached as opening.check_reached says; one named itself may be a link."""
    found: dict[str, SourceFile] = {}
    for pattern in patterns:
        expanded = os.path.expanduser(pattern)
        magic = glob.has_magic(expanded)
        matches = (
            sorted(glob.glob(expanded, recursive=True))
            if magic
            else [expanded]
            if os.path.exists(expanded)
            else []
        )
        if not matches:
            raise ConfigError(f"{key}: {pattern!r} matches no file or folder")
        for match in matches:
            if magic:
                check_reached(match, glob_root(expanded), key)
            for path, kind in _expand(Path(match).resolve(), key):
                stat = path.stat()
                found.setdefault(
                    str(path), SourceFile(str(path), kind, stat.st_size, stat.st_mtime_ns)
                )
    return list(found.values())


def kind_of(path: Path) -> str | None:
    name = path.name.lower()
    if name.endswith(".gz"):
        kind = SUFFIXES.get(Path(name[:-3]).suffix)
        return kind if kind in ("text", "jsonl") else None
    return SUFFIXES.get(path.suffix.lower())


def pieces(source: SourceFile, text_field: str) -> Iterator[tuple[Piece, int]]:
    """The source's text, with how many of its bytes on disk have been read so far."""
    reader = {
        "text": _text_pieces,
        "jsonl": _json_pieces,
        "parquet": _column_pieces,
        "arrow": _column_pieces,
    }[source.kind]
    empty = True
    for piece, done in reader(source, text_field):
        empty = False
        yield piece, done
    if empty:
        raise ConfigError(f"{source.path}: the file holds no documents; remove it from data.files")


def _expand(path: Path, key: str) -> Iterator[tuple[Path, str]]:
    if not path.is_dir():
        kind = kind_of(path)
        if kind is None:
            raise ConfigError(f"{key}: {path} is not a data file qgtrain reads; allowed: {ALLOWED}")
        check_regular(path)
        yield path, kind
        return
    if (path / "dataset_dict.json").is_file():
        splits = _json(path / "dataset_dict.json").get("splits", [])
        raise ConfigError(
            f"{key}: {path} holds a DatasetDict with splits {', '.join(splits)}; name the split "
            f"folders, e.g. data.files: ['{path}/train'] and data.val_files: ['{path}/validation']"
        )
    if (path / "state.json").is_file():
        yield from ((file, "arrow") for file in _saved_files(path, key))
        return
    inside = sorted(
        p
        for p in path.rglob("*")
        if not p.name.startswith(".") and kind_of(p) and p.exists() and not p.is_dir()
    )
    if not inside:
        raise ConfigError(f"{key}: the folder {path} holds no data files; allowed: {ALLOWED}")
    for file in inside:
        check_reached(file, path, key)
        check_regular(file)
        yield file, str(kind_of(file))


def _saved_files(folder: Path, key: str) -> Iterator[Path]:
    """The Arrow files a save_to_disk folder's state.json lists: plain file names inside it only
    (whoever wrote state.json could name any path)."""
    state = folder / "state.json"
    entries = _json(state).get("_data_files", [])
    for entry in entries if isinstance(entries, list) else [entries]:
        name = entry.get("filename") if isinstance(entry, dict) else entry
        if not isinstance(name, str) or name in ("", ".", "..") or os.path.basename(name) != name:
            raise ConfigError(
                f"{key}: {state} lists {name!r} in _data_files; only plain names of files in "
                f"{folder} are read (as datasets' save_to_disk writes them)"
            )
        check_reached(folder / name, folder, key)
        check_regular(folder / name)
        yield folder / name


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(read_text(path))
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _open(source: SourceFile) -> tuple[io.BufferedIOBase | BinaryIO, BinaryIO]:
    """The readable stream and the raw file under it, whose position counts bytes on disk."""
    raw = open_regular(source.path)
    return (gzip.open(raw) if source.path.lower().endswith(".gz") else raw), raw


def _text_pieces(source: SourceFile, text_field: str) -> Iterator[tuple[Piece, int]]:
    stream, raw = _open(source)
    with raw, stream:
        pending, produced = b"", False
        while True:
            block = stream.read(TEXT_PIECE_BYTES)
            text = pending + block
            if not block:  # the end of the file: what is left ends the document
                if text or produced:
                    yield Piece(text.decode("utf-8", "replace"), 0, True), raw.tell()
                return
            cut = text.rfind(b"\n") + 1
            pending = text[cut:]
            if cut:  # pieces end at a line end, so no word is cut in two
                yield Piece(text[:cut].decode("utf-8", "replace"), 0, False), raw.tell()
                produced = True


def _json_pieces(source: SourceFile, text_field: str) -> Iterator[tuple[Piece, int]]:
    for row, document, where, done in _json_rows(source):
        yield Piece(_field(row, text_field, where), document, True), done


def records(
    source: SourceFile, fields: tuple[str, ...]
) -> Iterator[tuple[dict[str, Any], str, int]]:
    """Each record of a JSON, parquet or arrow file as a dict (of `fields` only, for the column
    formats), where it is (file and line, item or row), and how many bytes on disk are read."""
    if source.kind == "jsonl":
        for row, _, where, done in _json_rows(source):
            if not isinstance(row, dict):
                raise ConfigError(f"{where}: expected a JSON object, got {type(row).__name__}")
            yield row, where, done
        return
    if source.kind == "text":
        raise ConfigError(
            f"{source.path}: a text file holds no records; data.format chat and "
            "prompt_completion read .jsonl, .json, .parquet, .arrow or save_to_disk "
            "folders"
        )
    reader = parquet_columns if source.kind == "parquet" else arrow_columns
    row = 0
    for columns, done in reader(source, fields):
        for values in zip(*columns):
            yield dict(zip(fields, values)), f"{source.path}: row {row}", done
            row += 1


def _json_rows(source: SourceFile) -> Iterator[tuple[Any, int, str, int]]:
    """(parsed value, document index, where, bytes read) of a JSON Lines file or a JSON array."""
    stream, raw = _open(source)
    with raw, stream:
        first = stream.peek(64).lstrip()[:1] if hasattr(stream, "peek") else b""
        if first == b"[":  # a JSON array of objects rather than JSON Lines: read whole
            try:
                rows = json.load(stream)
            except json.JSONDecodeError as exc:
                raise ConfigError(
                    f"{source.path}:{exc.lineno}: not valid JSON ({exc.msg})"
                ) from None
            for index, row in enumerate(rows):
                yield row, index, f"{source.path}: item {index}", raw.tell()
            return
        document = 0
        for number, line in enumerate(stream, start=1):
            if not line.strip():
                continue
            where = f"{source.path}:{number}"
            yield json_line(line, where), document, where, raw.tell()
            document += 1


def json_line(line: str | bytes, where: str) -> Any:
    """One JSON Lines record, or one line naming `where` (file and line, or byte) and the fault."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{where}: not valid JSON ({exc.msg}); each line must be one JSON object"
        ) from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text") from None


def _field(row: Any, text_field: str, where: str) -> str:
    if not isinstance(row, dict):
        raise ConfigError(
            f"{where}: expected a JSON object with a '{text_field}' field, got {type(row).__name__}"
        )
    if text_field not in row:
        raise ConfigError(
            f"{where}: no field '{text_field}' (fields there: "
            f"{', '.join(map(str, row)) or 'none'}); set data.text_field"
        )
    value = row[text_field]
    if not isinstance(value, str):
        raise ConfigError(f"{where}: field '{text_field}' holds {type(value).__name__}, not text")
    return value


def _column_pieces(source: SourceFile, text_field: str) -> Iterator[tuple[Piece, int]]:
    """A parquet or arrow source's text column, one document per row."""
    reader = parquet_columns if source.kind == "parquet" else arrow_columns
    document = 0
    for (values,), done in reader(source, (text_field,)):
        for text in column_texts(values, text_field, source.path, document):
            document += 1
            yield Piece(text, document - 1, True), done
