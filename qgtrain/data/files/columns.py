"""Parquet and Arrow files read by column: the named columns' values a batch of rows at a time, with
how many bytes on disk are read so far (for progress), and a missing column or a value that is not
text refused naming the file, the row and what to set. Apart from sources.py, which finds the files
and reads text and JSON: pyarrow is imported only here, and only when such a file is read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ...foundation.errors import ConfigError
from .opening import mapped

if TYPE_CHECKING:
    from .sources import SourceFile


def parquet_columns(
    source: SourceFile, fields: tuple[str, ...]
) -> Iterator[tuple[list[list[Any]], int]]:
    """The named columns' values, a batch of rows at a time, with the bytes read so far (estimated
    from the rows: parquet decodes whole column chunks)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(mapped(source.path))
    except (pa.ArrowException, OSError) as exc:
        raise ConfigError(f"{source.path}: not a readable parquet file ({exc})") from None
    for name in fields:
        check_column(file.schema_arrow.names, name, source.path)
    rows, done = max(1, file.metadata.num_rows), 0
    for batch in file.iter_batches(columns=list(fields), batch_size=4096):
        done += batch.num_rows
        yield [batch.column(name).to_pylist() for name in fields], source.size * done // rows


def arrow_columns(
    source: SourceFile, fields: tuple[str, ...]
) -> Iterator[tuple[list[list[Any]], int]]:
    import pyarrow as pa

    file = mapped(source.path)
    try:
        reader = pa.ipc.open_stream(file)
    except pa.ArrowInvalid:
        try:
            reader = pa.ipc.open_file(file)
        except (pa.ArrowException, OSError) as exc:
            raise ConfigError(f"{source.path}: not a readable Arrow file ({exc})") from None
    for name in fields:
        check_column(reader.schema.names, name, source.path)
    batches = (
        reader
        if isinstance(reader, pa.ipc.RecordBatchStreamReader)
        else (reader.get_batch(i) for i in range(reader.num_record_batches))
    )
    for batch in batches:
        yield [batch.column(name).to_pylist() for name in fields], file.tell()


def check_column(names: list[str], text_field: str, path: str) -> None:
    if text_field not in names:
        raise ConfigError(
            f"{path}: no column '{text_field}' (columns there: {', '.join(names)}); "
            "set data.text_field (for chat data: data.messages_field, "
            "data.prompt_field, data.completion_field)"
        )


def column_texts(values: list[Any], text_field: str, path: str, first: int) -> Iterator[str]:
    for offset, value in enumerate(values):
        if not isinstance(value, str):
            raise ConfigError(
                f"{path}: row {first + offset}: column '{text_field}' holds "
                f"{type(value).__name__}, not text"
            )
        yield value
