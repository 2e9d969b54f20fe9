"""A stream's plan (data.stream): the shards its files are cut into and every setting that decides
its samples, with their digest, which every saved position carries, so a resume on changed files
or settings fails in one line instead of continuing somewhere else. The cut depends on the files
alone, never on the world size (shards.py), so a position names the same shard on any world size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import xxhash

from ...config import DataConfig
from ...foundation.errors import ConfigError
from .. import chat, tokenizer
from ..cache import prepare_chat
from ..files import shards, sources


@dataclass(frozen=True)
class StreamPlan:
    """Everything that decides the samples of a stream; its digest is saved with every position."""

    shards: tuple[shards.Shard, ...]
    text_field: str
    tokenizer: str
    eos_id: int
    seq_len: int
    seed: int
    split_seed: int
    held_out: tuple[float, float]  # val, test: fractions of data.files' documents
    digest: str
    key: str = "data.files"  # the setting that names the files, in messages
    workers: int = 0  # data.num_workers: a rank's reading slots (not in the digest)
    records: DataConfig | None = None  # chat, prompt_completion: what renders them (chat_stream)

    def split_of(self, path: str, key: int) -> str:
        """prepare.py's draw for the cache, but keyed by a document's byte offset where the file
        is seekable (a shard that starts mid-file cannot count the documents before it)."""
        val, test = self.held_out
        if val + test == 0:
            return "train"
        draw = xxhash.xxh3_64_intdigest(f"{self.split_seed}\0{path}\0{key}".encode()) / 2.0**64
        return "val" if draw < val else "test" if draw < val + test else "train"


def plan(data: DataConfig, seed: int, key: str = "data.files") -> StreamPlan:
    """The plan of data.files (of a data.mix source: `key` names it in messages)."""
    files = sources.find(data.files, key)
    for file in files:  # the cache refuses it too (sources.py): here it would just yield nothing
        if file.size == 0:
            raise ConfigError(f"{file.path}: the file is empty (0 bytes); remove it from {key}")
        if data.format != "text" and file.kind == "text":  # its one line: records are not text
            next(sources.records(file, chat.fields(data)))
    held_out = tuple(
        0.0 if getattr(data, f"{s}_files") else getattr(data, f"{s}_fraction")
        for s in ("val", "test")
    )
    info = tokenizer.describe(data.tokenizer)
    cut = tuple(shards.cut(files))
    identity = [
        [(s.source.path, s.source.size, s.source.mtime_ns, s.start, s.end) for s in cut],
        data.text_field,
        info.fingerprint,
        data.seq_len,
        seed,
        data.split_seed,
        held_out,
    ]
    if data.format != "text":  # a text stream's digest stays as it was: its positions still load
        template = None if data.tokenizer == tokenizer.BYTE else chat.template_of(data.tokenizer)
        identity.append([prepare_chat.identity(data), template])
    digest = xxhash.xxh3_64_hexdigest(json.dumps(identity).encode())
    return StreamPlan(
        cut,
        data.text_field,
        data.tokenizer,
        info.eos_id,
        data.seq_len,
        seed,
        data.split_seed,
        (held_out[0], held_out[1]),
        digest,
        key,
        data.num_workers,
        None if data.format == "text" else data,
    )
