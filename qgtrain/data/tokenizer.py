"""Tokenizers: the built-in byte-level one, or a Hugging Face tokenizer folder, seen through one
interface.

The byte-level tokenizer is a real `tokenizers` model (GPT-2's byte-to-unicode alphabet, no merges),
built so that token id == byte value and 256 is <|endoftext|>. Tokenizing the corpus is then a plain
byte copy, and the exported model still ships a tokenizer that `AutoTokenizer.from_pretrained`
loads.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..foundation.errors import ConfigError

if TYPE_CHECKING:  # imported where used: describing a tokenizer needs no tokenizers library
    import tokenizers

EOS = "<|endoftext|>"
BYTE = "byte"


@dataclass(frozen=True)
class TokenizerInfo:
    spec: str
    vocab_size: int
    eos_id: int
    fingerprint: str


def describe(spec: str) -> TokenizerInfo:
    """Facts about the tokenizer named by data.tokenizer, without importing transformers."""
    if spec == BYTE:
        return TokenizerInfo(BYTE, 257, 256, "byte-v1")
    tok = _load_folder(spec)
    return TokenizerInfo(
        spec,
        tok.get_vocab_size(with_added_tokens=True),
        _eos_id(spec, tok),
        "sha-" + _digest(Path(spec, "tokenizer.json").read_bytes()),
    )


def encode(spec: str, documents: Iterable[str]) -> np.ndarray:
    """Token ids of every document, each followed by the end-of-text token, as one uint32 array."""
    docs = list(documents)
    return encode_pieces(spec, describe(spec).eos_id, docs, [True] * len(docs))


# per process: the preparation's workers load a folder once
_loaded: dict[str, tokenizers.Tokenizer] = {}


def encode_pieces(spec: str, eos_id: int, texts: list[str], ends: list[bool]) -> np.ndarray:
    """Token ids of the texts, each text that ends a document followed by the end-of-text token and
    no other special token (a long document comes in several texts; only its last ends it)."""
    eos = np.array([eos_id], dtype=np.uint32)
    if spec == BYTE:
        encoded = [
            np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32) for text in texts
        ]
    else:
        if spec not in _loaded:
            _loaded[spec] = _load_folder(spec)
        tok = _loaded[spec]
        # One text at a time: encode_batch would start its own threads in every worker process, and
        # it is no faster on one thread.
        encoded = [
            np.asarray(tok.encode(text, add_special_tokens=False).ids, dtype=np.uint32)
            for text in texts
        ]
    parts: list[np.ndarray] = []
    for ids, end in zip(encoded, ends):
        parts += [ids, eos] if end else [ids]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint32)


def load(spec: str) -> tokenizers.Tokenizer:
    """The tokenizer data.tokenizer names (or an export folder's), to encode and decode text piece
    by piece: downstream evaluation."""
    return byte_level() if spec == BYTE else _load_folder(spec)


def byte_level() -> tokenizers.Tokenizer:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = _bytes_to_unicode()
    vocab = {alphabet[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    return tok


def save(spec: str, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer files into out_dir so that `AutoTokenizer.from_pretrained(out_dir)` loads
    them."""
    if spec != BYTE:
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "vocab.json",
            "merges.txt",
            "tokenizer.model",
            "chat_template.jinja",
        ):
            if Path(spec, name).is_file():
                shutil.copy2(Path(spec, name), out_dir / name)
        return
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=byte_level(),
        eos_token=EOS,
        bos_token=EOS,
        unk_token=None,
        model_max_length=model_max_length,
    )
    fast.save_pretrained(out_dir)


def _load_folder(spec: str) -> tokenizers.Tokenizer:
    from tokenizers import Tokenizer

    path = Path(spec, "tokenizer.json")
    if not path.is_file():
        raise ConfigError(
            f"data.tokenizer: {spec!r} is neither 'byte' nor a folder with tokenizer.json "
            "(a Hugging Face fast tokenizer, as save_pretrained writes it)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises bare Exceptions for malformed files
        raise ConfigError(
            f"data.tokenizer: {path} could not be read as a tokenizer ({exc})"
        ) from None


def _eos_id(spec: str, tok: tokenizers.Tokenizer) -> int:
    config = Path(spec, "tokenizer_config.json")
    candidates = []
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        candidates.append(eos.get("content") if isinstance(eos, dict) else eos)
    candidates += [EOS, "</s>", "<eos>"]
    for token in candidates:
        found = tok.token_to_id(token) if token else None
        if found is not None:
            return int(found)
    raise ConfigError(
        f"data.tokenizer: {spec} has no end-of-text token (eos_token in tokenizer_config.json)"
    )


def _digest(data: bytes) -> str:
    import xxhash

    return xxhash.xxh3_64_hexdigest(data)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable unicode characters (what ByteLevel
    pre-tokenizes to)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, codes)}
