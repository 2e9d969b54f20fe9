"""The data section: the built-in corpus, the user's data files, synthetic tokens or a factory, and
how they are split, tokenized and loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .fields import MAX_TIMEOUT_S, Problem, factory_problem, setting

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
        "data.files)",
    )
    test_files: tuple[str, ...] = setting(
        (), "the test split's files ([] = hold out data.test_fraction)"
    )
    stream: bool = setting(
        False,
        "with name=files: read, tokenize and pack the files while training, no cache first "
        "(resumes exactly, also on another world size)",
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
    if cfg.data.name == "files" and not cfg.data.files:
        return "data.files", (
            "data.name is 'files' but no files are named; give globs, files or "
            "folders, e.g. ['/shared/corpus/*.jsonl.gz']"
        )
    if cfg.data.stream and cfg.data.name != "files":
        return "data.stream", (
            f"streams data files; set data.name: files (data.name is {cfg.data.name})"
        )
    if cfg.data.stream and cfg.data.format != "text":
        return "data.stream", (
            f"streams documents of text; data.format {cfg.data.format} is read from the "
            "cache (data.stream: false)"
        )
    if cfg.data.format != "text" and cfg.data.name != "files":
        return "data.format", (
            f"{cfg.data.format} reads data files; set data.name: files "
            f"(data.name is {cfg.data.name})"
        )
    if cfg.data.format == "chat" and cfg.data.tokenizer == "byte":
        return "data.tokenizer", (
            "'byte' has no chat template; data.format: chat needs a Hugging "
            "Face tokenizer folder with one (tokenizer_config.json's "
            "chat_template)"
        )
    if cfg.data.val_fraction + cfg.data.test_fraction >= 0.9:
        return "data.test_fraction", (
            "data.val_fraction + data.test_fraction must leave most text for training"
        )
    return None
