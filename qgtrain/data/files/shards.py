"""Data files cut into shards, the unit of work of a stream (data.stream), each read from any point.

A shard is a whole file, or a byte range of a large plain-text or JSON Lines file: those can be
entered at any byte (the range starts at the first line that begins in it, as Hadoop splits text),
so a 150 MB file is several shards read in parallel and a position in one is a byte offset, sought
in O(1). A parquet file is cut at its row groups (a position is a row: the row groups before it
are skipped by their counts, unread). A compressed file, a JSON array or arrow is one shard, read
through sources.py; a position in it is a count of documents, read past again on resume (parsed,
not tokenized).

The cut depends only on the files (SHARD_BYTES is fixed), never on the ranks or workers, so a
position saved by one world size names the same shard in another.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, BinaryIO

from ...foundation.errors import ConfigError
from . import sources
from .columns import check_column, column_texts
from .opening import mapped, open_regular

SHARD_BYTES = 16 << 20
UNIT_BYTES = 1 << 20  # a plain-text file is read in units of about this many bytes of whole lines


@dataclass(frozen=True)
class Shard:
    source: sources.SourceFile
    start: int  # [start, end): bytes of a seekable file, row groups of a parquet file
    end: int  # (a whole file otherwise: 0 and its size)
    seekable: bool

    @property
    def last(self) -> bool:
        """This shard ends its file: a plain-text file's one document ends here."""
        return self.end >= self.source.size


@dataclass(frozen=True)
class Unit:
    """A document, or a part of a plain-text file's one document, and where it starts."""

    text: str
    ends: bool  # ends a document: the end-of-text token follows it
    key: int  # the document's identity in its file, for the held-out draw
    index: int  # its number in the shard
    byte: int  # its first byte in the file (-1: not seekable)


@dataclass(frozen=True)
class Record:
    """A record of data.format chat or prompt_completion, and where it starts (as Unit)."""

    row: dict[str, Any]
    where: str  # for messages: file and line, item or row (a line at a byte: at_line numbers it)
    key: int
    index: int
    byte: int
    after: int  # the byte after it (-1: not seekable)


def cut(files: list[sources.SourceFile]) -> list[Shard]:
    shards = []
    for file in files:
        if file.kind == "parquet":
            shards += _row_groups(file)
            continue
        if not _seekable(file):
            shards.append(Shard(file, 0, file.size, False))
            continue
        starts = range(0, max(file.size, 1), SHARD_BYTES)
        shards += [Shard(file, s, min(s + SHARD_BYTES, file.size), True) for s in starts]
    return shards


def units(
    shard: Shard, text_field: str, index: int = 0, byte: int = -1, unit_bytes: int | None = None
) -> Iterator[Unit]:
    """The shard's units from unit `index` on, which starts at `byte` where the file is seekable;
    a plain-text file's units are about `unit_bytes` (UNIT_BYTES) of whole lines: 1 for a line
    each, where reading slots share the file a unit each (filestream.py)."""
    if shard.source.kind == "parquet":
        yield from _rows(shard, text_field, index)
        return
    if not shard.seekable:
        for number, (piece, _) in enumerate(sources.pieces(shard.source, text_field)):
            if number >= index:
                yield Unit(piece.text, piece.ends_document, piece.document, number, -1)
        return
    with _entered(shard, byte) as file:
        if shard.source.kind == "jsonl":
            yield from _lines(shard, file, text_field, index)
        else:
            yield from _text_units(shard, file, index, unit_bytes or UNIT_BYTES)


def records(
    shard: Shard, fields: tuple[str, ...], index: int = 0, byte: int = -1
) -> Iterator[Record]:
    """The shard's records (data.format chat, prompt_completion) from record `index` on, which
    starts at `byte` where the file is seekable: as units() reads documents, keyed the same way."""
    path = shard.source.path
    if shard.source.kind == "parquet":
        yield from _parquet_records(shard, fields, index)
    elif not shard.seekable or shard.source.kind == "text":  # text: refused by sources.records
        for number, (row, where, _) in enumerate(sources.records(shard.source, fields)):
            if number >= index:
                yield Record(row, where, number, number, -1, -1)
    else:
        with _entered(shard, byte) as file:
            for row, start, after, where in _objects(shard, file):
                if not isinstance(row, dict):
                    found = ConfigError(
                        f"{where}: expected a JSON object, got {type(row).__name__}"
                    )
                    raise at_line(found, where, path, start)
                yield Record(row, where, start, index, start, after)
                index += 1


def at_line(error: ConfigError, where: str, path: str, byte: int) -> ConfigError:
    """The error with `where` (a line named by its byte) named by its file and line number,
    counted only now: a shard entered mid-file does not know its line numbers."""
    line = 1
    with open_regular(path) as file:
        while byte > 0 and (chunk := file.read(min(byte, 1 << 20))):
            line, byte = line + chunk.count(b"\n"), byte - len(chunk)
    return ConfigError(str(error).replace(where, f"{path}:{line}", 1))


@contextmanager
def _entered(shard: Shard, byte: int) -> Iterator[BinaryIO]:
    """A seekable shard's file at `byte`, or at the first line that starts in the shard."""
    with open_regular(shard.source.path) as file:
        if byte >= 0:
            file.seek(byte)
        elif shard.start > 0:  # the line that starts at `start` or after it is the first
            file.seek(shard.start - 1)
            file.readline()
        yield file


def _seekable(file: sources.SourceFile) -> bool:
    if file.kind not in ("text", "jsonl") or file.path.lower().endswith(".gz"):
        return False
    if file.kind == "text":
        return True
    with open_regular(file.path) as handle:  # a JSON array is read whole, by sources.py
        return handle.read(64).lstrip()[:1] != b"["


def _lines(shard: Shard, file: BinaryIO, text_field: str, index: int) -> Iterator[Unit]:
    for row, start, _, where in _objects(shard, file):
        yield Unit(sources._field(row, text_field, where), True, start, index, start)
        index += 1


def _objects(shard: Shard, file: BinaryIO) -> Iterator[tuple[Any, int, int, str]]:
    """Each JSON line that starts in the shard: the value, its first byte, the byte after it, and
    where it is for messages."""
    position = file.tell()
    while position < shard.end:
        line = file.readline()
        if not line:
            return
        start, position = position, position + len(line)
        if not line.strip():
            continue
        where = f"{shard.source.path}: the line at byte {start}"
        try:
            value = sources.json_line(line, where)
        except ConfigError as exc:
            raise at_line(exc, where, shard.source.path, start) from None
        yield value, start, position, where


def _text_units(shard: Shard, file: BinaryIO, index: int, unit_bytes: int) -> Iterator[Unit]:
    """Whole lines, about `unit_bytes` at a time; the file's last unit ends its one document (an
    empty one where the last lines filled a unit)."""
    position = held_start = file.tell()
    held: list[bytes] = []
    size = 0
    while position < shard.end:
        line = file.readline()
        if not line:
            break
        held.append(line)
        position, size = position + len(line), size + len(line)
        if size >= unit_bytes:
            yield Unit(b"".join(held).decode("utf-8", "replace"), False, 0, index, held_start)
            held, size, held_start, index = [], 0, position, index + 1
    ends = shard.last
    if held or ends:
        yield Unit(b"".join(held).decode("utf-8", "replace"), ends, 0, index, held_start)


def _parquet(file: sources.SourceFile) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(mapped(file.path))
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{file.path}: not a readable parquet file ({exc})") from None


def _row_groups(file: sources.SourceFile) -> list[Shard]:
    """Consecutive row groups of about SHARD_BYTES (as the footer counts them) per shard."""
    meta, cut, size, first = _parquet(file).metadata, [], 0, 0
    for group in range(meta.num_row_groups):
        size += meta.row_group(group).total_byte_size
        if size >= SHARD_BYTES or group == meta.num_row_groups - 1:
            cut.append(Shard(file, first, group + 1, False))
            first, size = group + 1, 0
    return cut or [Shard(file, 0, 0, False)]


def _rows(shard: Shard, text_field: str, index: int) -> Iterator[Unit]:
    """The text column's rows from row `index` of the shard on; a document's key is its row in
    the file, as sources.py numbers documents for the cache."""
    file = _parquet(shard.source)
    check_column(file.schema_arrow.names, text_field, shard.source.path)
    row = sum(file.metadata.row_group(g).num_rows for g in range(shard.start))
    number, skip = index, index
    for group in range(shard.start, shard.end):
        rows = file.metadata.row_group(group).num_rows
        if skip < rows:
            values = file.read_row_group(group, columns=[text_field]).column(0).to_pylist()
            texts = column_texts(values[skip:], text_field, shard.source.path, row + skip)
            for offset, text in enumerate(texts, start=row + skip):
                yield Unit(text, True, offset, number, -1)
                number += 1
        skip, row = max(skip - rows, 0), row + rows


def _parquet_records(shard: Shard, fields: tuple[str, ...], index: int) -> Iterator[Record]:
    """The shard's rows of `fields` from row `index` of the shard on, each keyed by its row in the
    file (as _rows)."""
    file = _parquet(shard.source)
    for name in fields:
        check_column(file.schema_arrow.names, name, shard.source.path)
    row = sum(file.metadata.row_group(g).num_rows for g in range(shard.start))
    number, skip = index, index
    for group in range(shard.start, shard.end):
        rows = file.metadata.row_group(group).num_rows
        if skip < rows:
            columns = file.read_row_group(group, columns=list(fields)).columns
            values = zip(*(column.to_pylist()[skip:] for column in columns))
            for offset, found in enumerate(values, start=row + skip):
                where = f"{shard.source.path}: row {offset}"
                yield Record(dict(zip(fields, found)), where, offset, number, -1, -1)
                number += 1
        skip, row = max(skip - rows, 0), row + rows
