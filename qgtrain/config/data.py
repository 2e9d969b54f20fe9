"""The data section: the built-in corpus, the user's data files, synthetic tokens or a factory, and
how they are split, tokenized and loaded."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .fields import MAX_TIMEOUT_S, Problem, factory_problem, files_problem, name_problem, setting

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass(frozen=True)
class DataConfig:
    name: Literal["corpus", "files", "synthetic", "factory"] = setting(
        "corpus",
        "corpus: the built-in text; files: your data files (data.files); synthetic: "
        "random tokens (tests); factory",
    )
    corpus: str = setting(
        "stdlib", "'stdlib' (Python's own sources, always present) or a .txt file or folder"
    )
    corpus_mb: float = setting(4.0, "megabytes of text taken from the corpus", min=0.01)
    tokenizer: str = setting(
        "byte", "'byte' (byte-level, 257 tokens) or a folder with a Hugging Face tokenizer"
    )
    cache_dir: str = setting(
        "data", "where tokenized corpora are cached, shared by runs with the same text"
    )
    seq_len: int = setting(128, "tokens per training sample", min=2)
    val_fraction: float = setting(
        0.05, "share of the corpus held out for validation", min=0.0, max=0.5
    )
    test_fraction: float = setting(
        0.05, "share of the corpus held out for the final test", min=0.0, max=0.5
    )
    files: tuple[str, ...] = setting(
        (),
        "with name=files: globs, files or folders of text: .txt, .jsonl, .json, .jsonl.gz, "
        ".parquet, or a folder written by datasets' save_to_disk",
    )
    val_files: tuple[str, ...] = setting(
        (),
        "the validation split's files ([] = hold out data.val_fraction of the documents in "
        "data.files, or of each data.mix source; named beside data.mix, no source holds any "
        "out for validation: one fixed set to compare runs)",
    )
    test_files: tuple[str, ...] = setting(
        (),
        "the test split's files ([] = hold out data.test_fraction; beside data.mix as "
        "data.val_files)",
    )
    stream: bool = setting(
        False,
        "with name=files: read, tokenize (chat: render) and pack the files while training, no "
        "cache first (resumes exactly, also on another world size; with data.mix on the same one)",
    )
    text_field: str = setting(
        "text", "the JSON field or parquet/arrow column that holds each document's text"
    )
    format: Literal["text", "chat", "prompt_completion"] = setting(
        "text",
        "text: documents cut into windows; chat: records of messages rendered with the "
        "tokenizer's chat template; prompt_completion: prompt and completion fields (chat and "
        "prompt_completion: the loss counts only the answer's tokens)",
    )
    packing: bool = setting(
        True,
        "chat, prompt_completion: several samples per row of seq_len, attending only within "
        "their own; false: one sample per row, padded",
    )
    messages_field: str = setting(
        "messages", "chat: the field of each record's list of {role, content}"
    )
    prompt_field: str = setting("prompt", "prompt_completion: the field of each record's prompt")
    completion_field: str = setting("completion", "prompt_completion: the field of its answer")
    split_seed: int = setting(
        0,
        "which documents the held-out fractions take (a change re-tokenizes)",
        min=0,
        max=2**31 - 1,
    )
    prepare_workers: int = setting(
        0, "processes that tokenize data files (0 = every CPU the job was given)", min=0
    )
    prepare_timeout_s: float = setting(
        86400.0,
        "seconds the other ranks wait for the data to be tokenized",
        min=1.0,
        max=MAX_TIMEOUT_S,
    )
    num_workers: int = setting(0, "DataLoader worker processes per rank", min=0)
    mix: tuple[dict[str, Any], ...] = setting(
        (),
        "with name=files, instead of data.files: weighted sources, e.g. [{name: web, files: "
        "['web/*.jsonl'], weight: 6}, {name: code, files: ['code/*.py'], weight: 3}]; each "
        "training sample is drawn from one source by weight, a source that runs out starts its "
        "next pass; validation and test: data.val_files (data.test_files), else each "
        "source's held-out fractions, pooled; with data.stream each source is streamed and "
        "needs a file (or 16 MB) per reading slot",
    )
    dispatch: bool = setting(
        False,
        "a stream (an IterableDataset train split, or data.mix) read by rank 0 alone, which "
        "sends each rank its batches: for a stream that cannot be split over ranks",
    )
    synthetic_samples: int = setting(4096, "samples in the synthetic set", min=1)
    factory: str | None = setting(
        None,
        "'package.module:function' called with (seq_len, seed), returning (train, val, "
        "test, vocab_size)",
    )


def data_rules(cfg: RunConfig) -> Problem:
    if cfg.data.name == "factory" and not cfg.data.factory:
        return "data.factory", "data.name is 'factory' but no 'package.module:function' is given"
    if problem := factory_problem("data.factory", cfg.data.factory):
        return problem
    if problem := mix_problem(cfg.data):
        return problem
    if cfg.data.name == "files" and not cfg.data.files and not cfg.data.mix:
        return "data.files", (
            "data.name is 'files' but no files are named; give globs, files or "
            "folders, e.g. ['/shared/corpus/*.jsonl.gz']"
        )
    if cfg.data.stream and cfg.data.name != "files":
        return "data.stream", (
            f"streams data files; set data.name: files (data.name is {cfg.data.name})"
        )
    if cfg.data.format != "text" and cfg.data.name != "files":
        return "data.format", (
            f"{cfg.data.format} reads data files; set data.name: files "
            f"(data.name is {cfg.data.name})"
        )
    if cfg.data.format == "chat" and cfg.data.tokenizer == "byte" and not cfg.model.pretrained:
        return "data.tokenizer", (
            "'byte' has no chat template; data.format: chat needs a Hugging "
            "Face tokenizer folder with one (tokenizer_config.json's "
            "chat_template), or model.pretrained's own"
        )
    if cfg.data.val_fraction + cfg.data.test_fraction >= 0.9:
        return "data.test_fraction", (
            "data.val_fraction + data.test_fraction must leave most text for training"
        )
    return None


MIX_KEYS = {"name", "files", "weight"}


def mix_problem(data: DataConfig) -> Problem:
    """data.mix's sources: each named once (the name is its metrics key, samples_<name>), with
    files and a positive weight; their held-out splits are fractions of their own documents, or
    data.val_files / data.test_files, which users keep fixed to compare runs by."""
    if not data.mix:
        return None
    if data.name != "files":
        return "data.mix", (f"mixes data files; set data.name: files (data.name is {data.name})")
    if data.files:  # the held-out files are allowed: one fixed set beside every source
        return "data.files", (
            "with data.mix each source names its own files (data.mix[i].files); leave it empty"
        )
    if data.format != "text":
        return "data.format", f"data.mix mixes text sources; {data.format} is not mixed yet"
    seen: set[str] = set()
    for index, source in enumerate(data.mix):
        if problem := _source_problem(f"data.mix[{index}]", source, seen):
            return problem
    return None


def _source_problem(where: str, source: object, seen: set[str]) -> Problem:
    if not isinstance(source, dict) or set(source) != MIX_KEYS:
        found = sorted(source) if isinstance(source, dict) else type(source).__name__
        return where, f"each source is {{name, files, weight}}, got {found}"
    name, files, weight = source["name"], source["files"], source["weight"]
    if problem := name_problem(where, "source", name, seen):
        return problem
    if problem := files_problem(where, f"source {name!r}", files, "globs, files or folders"):
        return problem
    if (
        isinstance(weight, bool)
        or not isinstance(weight, (int, float))
        or not math.isfinite(weight)
        or weight <= 0
    ):
        return f"{where}.weight", (
            f"source {name!r} has weight {weight!r}; weights are positive numbers "
            "(a source's share is its weight / the sum of the weights)"
        )
    return None
