"""The built-in task and qgtrain's main job: a causal language model on windows of tokens.

The model and data come from the model and data sections of the config: a transformers model built
from a config, a pretrained folder, or a factory; the built-in corpus, a synthetic set, or a
factory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from ..config import DataConfig, RunConfig
from ..data import corpus, tokenizer
from ..data.cache import prepare
from ..data.rows import ChatArray, ChatRows
from ..data.stream import chat_stream, filestream, heldout
from ..data.tokens import SyntheticTokens, TokenWindows
from ..foundation.errors import ConfigError, TaskError
from ..foundation.factory import load_factory
from ..foundation.task import Task
from ..runtime import distributed
from . import lm_shape, mixture
from .models import build_model, lm_loss


@dataclass(frozen=True)
class Splits:
    train: Dataset[Any]
    val: Dataset[Any]
    test: Dataset[Any]
    vocab_size: int


def causal_lm(cfg: RunConfig) -> Task:
    """Rank 0 tokenizes the text (once per text and tokenizer); the other ranks open what it wrote,
    or on a node that cannot see it (a node-local data.cache_dir), one rank of that node tokenizes
    it again."""
    prepared = None
    if cfg.data.mix and cfg.data.stream:  # each source read while training, nothing cached
        splits = Splits(*mixture.streamed_splits(cfg.data, cfg.train.seed))
    elif cfg.data.mix:
        folders = distributed.main_works_long(
            lambda: mixture.prepare_sources(cfg.data, cfg.logging.shared),
            f"is tokenizing the data.mix sources into {cfg.data.cache_dir}",
            ("data.prepare_timeout_s", cfg.data.prepare_timeout_s),
            lambda folders: all(Path(folder, "meta.json").is_file() for folder in folders),
        )
        train, val, test, prepared = mixture.mixture_splits(cfg.data, folders, cfg.train.seed)
        splits = Splits(train, val, test, prepared.vocab_size)
    elif cfg.data.name in ("corpus", "files") and not cfg.data.stream:
        folder = distributed.main_works_long(
            lambda: str(_prepare(cfg.data, cfg.logging.shared)),
            f"is tokenizing the data into {cfg.data.cache_dir}",
            ("data.prepare_timeout_s", cfg.data.prepare_timeout_s),
            lambda folder: Path(folder, "meta.json").is_file(),
        )
        prepared = corpus.load(Path(folder))
    if not cfg.data.mix:
        splits = build_splits(cfg.data, prepared, cfg.train.seed)
    eos_id = _eos_id(cfg.data, prepared)
    shape = lm_shape.for_run(cfg.model)  # a resumed run's model as it began
    model = build_model(cfg.model, splits.vocab_size, cfg.data.seq_len, eos_id, shape)
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    if embeddings is not None and embeddings.num_embeddings < splits.vocab_size:
        raise ConfigError(
            f"data.tokenizer: {cfg.data.tokenizer} has {splits.vocab_size} tokens but the model "
            f"embeds only {embeddings.num_embeddings}; use the tokenizer the model was trained with"
        )
    default_cache = lm_shape.keeps_default_cache()  # a run begun before keeps it: bit for bit
    facts = {
        "vocab_size": splits.vocab_size,
        "seq_len": cfg.data.seq_len,
        "eos_id": eos_id,
        "tokenizer": _tokenizer_spec(cfg.data),
        "data": str(prepared.folder) if prepared else None,
        **lm_shape.facts_of(model),
        lm_shape.TRAINING_CACHE: default_cache,
    }
    return Task(
        model=model,
        train=splits.train,
        val=splits.val,
        test=splits.test,
        loss=functools.partial(lm_loss, default_cache=True) if default_cache else lm_loss,
        tokens=batch_tokens,
        facts=facts,
        flops_per_sample=training_flops(model, cfg.data.seq_len),
    )


def _tokenizer_spec(data: DataConfig) -> str | None:
    """What writes text as the run's tokens (evaluation's tasks need it): none for a factory's
    data."""
    if data.name == "synthetic":
        return "byte"
    return data.tokenizer if data.name in ("corpus", "files") else None


def _eos_id(data: DataConfig, prepared: corpus.TokenFiles | None) -> int | None:
    """The token that ends a document, if the data has one the model should know of."""
    return (
        prepared.eos_id
        if prepared
        else 256
        if data.name == "synthetic"
        else tokenizer.describe(data.tokenizer).eos_id
        if data.stream
        else None
    )


def _prepare(data: DataConfig, shared: bool) -> Path:
    if data.name == "files":
        return prepare.prepare(data, data.prepare_workers, shared)[0].folder
    return corpus.prepare(data, shared).folder


def training_flops(model: torch.nn.Module, seq_len: int) -> float:
    """Per sample of seq_len tokens: 6 x parameters per token (forward and backward matrix
    products), plus attention's 12 x layers x width x seq_len per token (PaLM's appendix B, as
    nanoGPT counts). Embedding lookups multiply nothing, so their tables are left out; an output
    head that shares the token embedding's table is a matrix product and counts."""
    params = sum(p.numel() for p in model.parameters())
    tables = {
        id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding)
    }
    head = getattr(model, "get_output_embeddings", lambda: None)()
    tables.pop(id(getattr(head, "weight", None)), None)
    config = getattr(model, "config", None)
    layers, width = getattr(config, "num_hidden_layers", 0), getattr(config, "hidden_size", 0)
    matmul_params = params - sum(tables.values())
    return float(seq_len * (6 * matmul_params + 12 * layers * width * seq_len))


def batch_tokens(batch: torch.Tensor | dict[str, torch.Tensor]) -> int:
    """The real tokens of a batch, for tokens/s and tokens_seen: padded chat rows (data.packing
    false) carry an attention_mask that is 0 on padding, which is not counted. Called on the host
    batch (training/report.py), so the mask's sum syncs no GPU. MFU stays with training_flops: a
    padded row still costs a whole row of compute."""
    if isinstance(batch, dict) and "attention_mask" in batch:
        return int(batch["attention_mask"].sum())
    return (batch["input_ids"] if isinstance(batch, dict) else batch).numel()


def _split(prepared: corpus.TokenFiles, split: str, seq_len: int) -> TokenWindows | ChatRows:
    if prepared.format == "text":
        return TokenWindows(str(prepared.path(split)), prepared.dtype, seq_len)
    return ChatRows(prepared.folder, split, prepared.dtype, seq_len, prepared.packing)


def build_splits(data: DataConfig, prepared: corpus.TokenFiles | None, seed: int) -> Splits:
    """The three splits of the source data.name names (SOURCES); the corpus and data files must have
    been prepared on rank 0 first."""
    return SOURCES[data.name](data, prepared, seed)


def _prepared_splits(data: DataConfig, prepared: corpus.TokenFiles | None, seed: int) -> Splits:
    assert prepared is not None
    windows = {split: _split(prepared, split, data.seq_len) for split in corpus.SPLITS}
    for split, dataset in windows.items():
        if (split == "train" or getattr(data, f"{split}_fraction") > 0) and len(dataset) == 0:
            source = _source_key(data, split)
            raise ConfigError(
                f"{source}: the {split} split has {prepared.tokens[split]} tokens, "
                f"fewer than data.seq_len={data.seq_len}; use more text or a shorter "
                "seq_len"
            )
    return Splits(windows["train"], windows["val"], windows["test"], prepared.vocab_size)


def _files_splits(data: DataConfig, prepared: corpus.TokenFiles | None, seed: int) -> Splits:
    """The cached files' windows, or with data.stream the files read while training: held-out
    splits in memory (heldout.py; chat records' rows: chat_stream.py), the train split a stream
    (filestream.py)."""
    if not data.stream:
        return _prepared_splits(data, prepared, seed)
    plan = filestream.plan(data, seed)
    filestream.check(plan)
    held: Mapping[str, heldout.TokenArray | ChatArray] = (
        heldout.held_out(data, plan) if data.format == "text" else chat_stream.held_out(data, plan)
    )
    for split, dataset in held.items():
        if (getattr(data, f"{split}_files") or getattr(data, f"{split}_fraction")) and len(
            dataset
        ) == 0:
            raise ConfigError(
                f"{_source_key(data, split)}: the {split} split has fewer than "
                f"data.seq_len={data.seq_len} tokens in the first "
                f"{heldout.HELD_OUT_BYTES >> 20} MB read for it (data.stream); use "
                "more text, a larger fraction or a shorter seq_len"
            )
    vocab = tokenizer.describe(data.tokenizer).vocab_size
    return Splits(filestream.FileStream(plan), held["val"], held["test"], vocab)


def _source_key(data: DataConfig, split: str) -> str:
    """The setting that decides how much text a split of the corpus or the data files gets."""
    if data.name == "corpus":
        return "data.corpus_mb"
    if split == "train":
        return "data.files"
    return f"data.{split}_files" if getattr(data, f"{split}_files") else f"data.{split}_fraction"


def _synthetic_splits(data: DataConfig, prepared: corpus.TokenFiles | None, seed: int) -> Splits:
    n_val = max(1, int(data.synthetic_samples * data.val_fraction))
    n_test = max(1, int(data.synthetic_samples * data.test_fraction))
    vocab = 257
    return Splits(
        SyntheticTokens(data.synthetic_samples, data.seq_len, vocab, seed),
        SyntheticTokens(n_val, data.seq_len, vocab, seed + 1),
        SyntheticTokens(n_test, data.seq_len, vocab, seed + 2),
        vocab,
    )


def _factory_splits(data: DataConfig, prepared: corpus.TokenFiles | None, seed: int) -> Splits:
    made = load_factory(str(data.factory), "data.factory")(seq_len=data.seq_len, seed=seed)
    if not (isinstance(made, tuple) and len(made) == 4):
        raise TaskError(
            f"data.factory: {data.factory} must return (train, val, test, vocab_size), "
            f"got {type(made).__name__}"
        )
    return Splits(*made)


# data.name -> the splits it gives: a new source is a function here and a name in config/data.py
SOURCES: dict[str, Callable[[DataConfig, corpus.TokenFiles | None, int], Splits]] = {
    "corpus": _prepared_splits,
    "files": _files_splits,
    "synthetic": _synthetic_splits,
    "factory": _factory_splits,
}
