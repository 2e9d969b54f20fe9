"""The built-in text corpus: collected once, tokenized once into memory-mapped files that later runs
reuse.

The default text is Python's own standard library, which every Python install carries, so the main
job needs no network and no download. A cache entry is keyed by a hash of the text and the
tokenizer, written to a temporary folder and renamed into place, so concurrent jobs never see half a
file.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from ..config import DataConfig
from ..foundation.errors import ConfigError
from . import tokenizer
from .cache.lock import private_temp_dir, seal
from .files.opening import check_reached, open_regular

SPLITS = ("train", "val", "test")
_SKIP_DIRS = {
    "test",
    "tests",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "idlelib",
    "lib2to3",
    "ensurepip",
    "pydoc_data",
    "turtledemo",
    "encodings",
}


@dataclass(frozen=True)
class TokenFiles:
    """A prepared corpus: one token file per split, all of `dtype`."""

    folder: Path
    dtype: str
    vocab_size: int
    eos_id: int
    tokens: dict[str, int]
    format: str = "text"  # chat and prompt_completion: rows laid out by rows.py
    packing: bool = True

    def path(self, split: str) -> Path:
        return self.folder / f"{split}.bin"


def prepare(data: DataConfig, shared: bool = False) -> TokenFiles:
    """Tokenize the configured corpus into the cache, unless an identical entry is already there;
    `shared` (logging.shared): the group may read it."""
    info = tokenizer.describe(data.tokenizer)
    docs = list(_documents(data.corpus, int(data.corpus_mb * 1_000_000)))
    digest = xxhash.xxh3_64()
    for item in (info.fingerprint, repr((data.val_fraction, data.test_fraction))):
        digest.update(item.encode())
    for name, text in docs:
        digest.update(name.encode() + b"\0" + text.encode("utf-8", "replace"))
    folder = Path(data.cache_dir) / f"corpus-{digest.hexdigest()}"
    if (folder / "meta.json").is_file():
        return load(folder)
    # A fixed, content-independent order that still mixes files from different modules into every
    # split.
    docs.sort(key=lambda doc: xxhash.xxh3_64_intdigest(doc[0].encode()))
    ids = tokenizer.encode(data.tokenizer, (text for _, text in docs))
    dtype = np.uint16 if info.vocab_size <= 65535 else np.uint32
    n_val, n_test = int(len(ids) * data.val_fraction), int(len(ids) * data.test_fraction)
    n_train = len(ids) - n_val - n_test
    parts = {
        "train": ids[:n_train],
        "val": ids[n_train : n_train + n_val],
        "test": ids[n_train + n_val :],
    }
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = private_temp_dir(folder)  # its own new folder, never one planted (or linked) there
    for split, tokens in parts.items():
        tokens.astype(dtype).tofile(tmp / f"{split}.bin")
    meta = {
        "dtype": np.dtype(dtype).name,
        "vocab_size": info.vocab_size,
        "eos_id": info.eos_id,
        "tokens": {split: int(len(t)) for split, t in parts.items()},
        "tokenizer": data.tokenizer,
        "corpus": data.corpus,
        "documents": len(docs),
    }
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    seal(tmp, shared)
    try:
        tmp.rename(folder)
    except OSError:  # another job finished the same entry first: theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    return load(folder)


def load(folder: Path) -> TokenFiles:
    meta = json.loads((folder / "meta.json").read_text())
    return TokenFiles(
        folder,
        meta["dtype"],
        meta["vocab_size"],
        meta["eos_id"],
        meta["tokens"],
        meta.get("format", "text"),
        meta.get("packing", True),
    )


def _documents(source: str, budget: int) -> Iterator[tuple[str, str]]:
    """(name, text) pairs in a stable order, until `budget` bytes of text have been taken."""
    walked = None  # a folder of the user's, whose files are reached as data.files' would be
    if source == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        files = _walk(root, (".py",))
    else:
        root = Path(source)
        if root.is_file():
            files, root = [root], root.parent
        elif root.is_dir():
            files, walked = _walk(root, (".txt", ".md", ".rst", ".py")), root
        else:
            raise ConfigError(
                f"data.corpus: {source!r} is neither 'stdlib' nor an existing file or folder"
            )
        if not files:
            raise ConfigError(f"data.corpus: {source} holds no .txt, .md, .rst or .py files")
    taken = 0
    for path in files:
        if taken >= budget:
            return
        if walked:
            check_reached(path, walked, "data.corpus")
        with open_regular(path) as handle:
            text = handle.read(budget - taken).decode("utf-8", "replace")
        taken += len(text.encode("utf-8"))
        yield str(path.relative_to(root)), text


def _walk(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS and not d.startswith("."))
        found += [Path(folder, n) for n in sorted(names) if n.endswith(suffixes)]
    return found
