"""A user's data files, tokenized once into a cache. Runs against: real files of every format
written here (gzip, parquet by pyarrow, a save_to_disk folder by Hugging Face datasets), a real BPE
tokenizer trained here and saved by transformers, real `qgtrain` processes SIGKILLed mid-way or
racing for one cache, and real 2-rank gloo groups. With the byte tokenizer a token file decodes back
to the exact documents, so each test checks what was written, not only that something was."""

from __future__ import annotations

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from qgtrain.data.cache import prepare as preparing
from qgtrain.data.corpus import TokenFiles
from qgtrain.foundation.errors import ConfigError
from tests.helpers import (
    assert_resumed_equals,
    cli,
    data,
    documents,
    kill_once_saved,
    train_command,
    wait_for,
    works_once,
    write_jsonl,
)
from tests.ranks import ROOT, run_ranks, start_cli_ranks, wait_ranks


def decoded(files: TokenFiles, split: str) -> list[str]:
    """The documents of a split cache made with the byte tokenizer (id == byte, 256 ends a
    document)."""
    ids = np.fromfile(files.path(split), dtype=files.dtype)
    ends = np.flatnonzero(ids == files.eos_id)
    assert len(ids) == 0 or ends[-1] == len(ids) - 1, (
        "every document must end with the end-of-text token"
    )
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [bytes(ids[s:e].astype(np.uint8)).decode() for s, e in zip(starts, ends)]


def all_documents(files: TokenFiles) -> list[str]:
    return sorted(decoded(files, "train") + decoded(files, "val") + decoded(files, "test"))


def bpe_tokenizer(folder: Path) -> Path:
    """A real byte-level BPE tokenizer trained on our words, saved the way transformers saves
    one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(documents(300, 99), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def test_every_format_decodes_back_to_exactly_its_documents(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    sets = {
        name: documents(30, seed)
        for seed, name in enumerate(
            ["jsonl", "gz", "array", "parquet", "saved", "txt", "txtgz", "ndjson", "md"]
        )
    }
    write_jsonl(tmp_path / "a.jsonl", sets["jsonl"])
    write_jsonl(tmp_path / "e.ndjson", sets["ndjson"])
    (tmp_path / "notes").mkdir()
    for i, doc in enumerate(sets["md"]):
        (tmp_path / "notes" / f"{i:02}.md").write_text(doc)
    write_jsonl(tmp_path / "b.jsonl.gz", sets["gz"])
    (tmp_path / "c.json").write_text(json.dumps([{"text": doc} for doc in sets["array"]]))
    pq.write_table(
        pa.table({"text": sets["parquet"], "n": list(range(30))}),
        tmp_path / "d.parquet",
        row_group_size=7,
    )
    Dataset.from_dict({"text": sets["saved"]}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "texts").mkdir()
    for i, doc in enumerate(sets["txt"]):
        (tmp_path / "texts" / f"{i:02}.txt").write_text(doc)
    # not a data file: passed over in a folder
    (tmp_path / "texts" / "notes.bin").write_bytes(b"\0\1")
    for i, doc in enumerate(sets["txtgz"]):
        (tmp_path / f"z{i:02}.txt.gz").write_bytes(gzip.compress(doc.encode()))

    cfg = data(
        tmp_path,
        tmp_path / "a.jsonl",
        tmp_path / "b.jsonl.gz",
        tmp_path / "c.json",
        tmp_path / "d.parquet",
        tmp_path / "saved",
        tmp_path / "texts",
        tmp_path / "z*.txt.gz",
        tmp_path / "e.ndjson",
        tmp_path / "notes",
    )
    files, made = preparing.prepare(cfg)
    assert made
    assert all_documents(files) == sorted(doc for docs in sets.values() for doc in docs)
    meta = json.loads((files.folder / "meta.json").read_text())
    assert sum(meta["documents"].values()) == 9 * 30 and files.dtype == "uint16"


def test_a_long_text_file_is_read_in_pieces_but_stays_one_document(tmp_path, monkeypatch):
    monkeypatch.setattr("qgtrain.data.files.sources.TEXT_PIECE_BYTES", 64)
    text = (
        "".join(f"line {i} " + "x" * (i % 90) + "\n" for i in range(200)) + "no newline at the end"
    )
    (tmp_path / "long.txt").write_text(text)
    files, _ = preparing.prepare(
        data(tmp_path, tmp_path / "long.txt", val_fraction=0.0, test_fraction=0.0)
    )
    assert decoded(files, "train") == [text]


def test_held_out_fractions_are_deterministic_for_a_seed_and_change_with_it(tmp_path):
    write_jsonl(tmp_path / "all.jsonl", documents(2000, 1))
    first, _ = preparing.prepare(
        data(tmp_path / "one", tmp_path / "all.jsonl", val_fraction=0.1, test_fraction=0.2)
    )
    again, _ = preparing.prepare(
        data(tmp_path / "two", tmp_path / "all.jsonl", val_fraction=0.1, test_fraction=0.2)
    )
    other, _ = preparing.prepare(
        data(
            tmp_path / "one",
            tmp_path / "all.jsonl",
            val_fraction=0.1,
            test_fraction=0.2,
            split_seed=7,
        )
    )
    for split in ("train", "val", "test"):
        assert first.path(split).read_bytes() == again.path(split).read_bytes()
    assert decoded(first, "val") != decoded(other, "val") and other.folder != first.folder
    counts = {split: len(decoded(first, split)) for split in ("train", "val", "test")}
    assert 140 < counts["val"] < 260 and 330 < counts["test"] < 470 and sum(counts.values()) == 2000
    assert set(decoded(first, "val")).isdisjoint(decoded(first, "train"))


def test_splits_from_their_own_files(tmp_path):
    train, val, test = documents(40, 1), documents(10, 2), documents(12, 3)
    write_jsonl(tmp_path / "train.jsonl", train)
    write_jsonl(tmp_path / "val.jsonl", val)
    write_jsonl(tmp_path / "test.jsonl.gz", test)
    files, _ = preparing.prepare(
        data(
            tmp_path,
            tmp_path / "train.jsonl",
            val_files=(str(tmp_path / "val.jsonl"),),
            test_files=(str(tmp_path / "test.jsonl.gz"),),
        )
    )
    assert (decoded(files, "train"), decoded(files, "val"), decoded(files, "test")) == (
        train,
        val,
        test,
    )


def test_a_hugging_face_tokenizer_in_worker_processes_matches_a_plain_loop(tmp_path):
    from tokenizers import Tokenizer

    folder = bpe_tokenizer(tmp_path / "tok")
    for shard in range(3):
        write_jsonl(tmp_path / f"s{shard}.jsonl", documents(400, shard + 10))
    cfg = data(
        tmp_path, tmp_path / "s*.jsonl", tokenizer=str(folder), val_fraction=0.0, test_fraction=0.0
    )
    monkey_batch = preparing.BATCH_BYTES
    preparing.BATCH_BYTES = 4096  # many batches in flight across the two workers
    try:
        alone, _ = preparing.prepare(replace(cfg, cache_dir=str(tmp_path / "one")), workers=1)
        pooled, _ = preparing.prepare(replace(cfg, cache_dir=str(tmp_path / "two")), workers=2)
    finally:
        preparing.BATCH_BYTES = monkey_batch
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    expected = [
        i
        for shard in range(3)
        for doc in documents(400, shard + 10)
        for i in tok.encode(doc).ids + [eos]
    ]
    assert alone.path("train").read_bytes() == pooled.path("train").read_bytes()
    assert np.fromfile(pooled.path("train"), dtype=pooled.dtype).tolist() == expected
    assert pooled.vocab_size == tok.get_vocab_size() and pooled.eos_id == eos


def test_a_prepared_cache_is_reused_and_a_changed_file_is_prepared_again(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", documents(50, 1))
    sets = [
        "--set",
        "data.name=files",
        f"data.files=[{path}]",
        f"data.cache_dir={tmp_path / 'cache'}",
    ]
    first = cli("data", "prepare", *sets, cwd=tmp_path)
    assert first.returncode == 0 and first.stdout.startswith("prepared "), first.stderr
    entry = Path(first.stdout.split()[1].rstrip(":"))
    stamp = (entry / "train.bin").stat()
    second = cli("data", "prepare", *sets, cwd=tmp_path)
    assert (
        second.stdout.startswith("already prepared, reused ") and "tokenizing" not in second.stderr
    )
    assert (entry / "train.bin").stat().st_mtime_ns == stamp.st_mtime_ns

    write_jsonl(path, documents(60, 2))
    info = cli("data", "info", str(entry), cwd=tmp_path)
    assert f"no: 1 file(s) changed since, e.g. {path}" in info.stdout
    third = cli("data", "prepare", *sets, cwd=tmp_path)
    assert third.stdout.startswith("prepared ") and str(entry) not in third.stdout
    listing = json.loads(
        cli("data", "info", "--json", str(tmp_path / "cache"), cwd=tmp_path).stdout
    )
    assert sorted(len(e["changed"]) for e in listing) == [0, 1]
    assert sorted(sum(e["documents"].values()) for e in listing) == [50, 60]


def slow_corpus(tmp_path: Path) -> list[str]:
    folder = bpe_tokenizer(tmp_path / "tok")
    for shard in range(4):
        write_jsonl(tmp_path / f"big{shard}.jsonl", documents(2000, shard, words=200))
    return [
        "--set",
        "data.name=files",
        f"data.files=[{tmp_path}/big*.jsonl]",
        f"data.tokenizer={folder}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.prepare_workers=1",
    ]


def start(args: list[str], cwd: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "qgtrain", *args],
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
    )


@pytest.mark.slow
def test_a_preparation_killed_midway_leaves_nothing_trusted_and_the_next_one_finishes(tmp_path):
    sets = slow_corpus(tmp_path)
    proc = start(["data", "prepare", *sets], tmp_path)
    started = lambda: list((tmp_path / "cache").glob("*.tmp-*/train.bin"))  # noqa: E731
    wait_for(started, [proc], "the preparation's first tokens", 120, 0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not [p for p in (tmp_path / "cache").iterdir() if (p / "meta.json").exists()]
    assert list((tmp_path / "cache").glob("*.tmp-*")), "the kill must land inside the preparation"
    done = cli("data", "prepare", *sets, cwd=tmp_path)
    assert done.returncode == 0 and done.stdout.startswith("prepared "), done.stderr
    assert not list((tmp_path / "cache").glob("*.tmp-*"))
    clean = cli("data", "prepare", *sets, "data.cache_dir=" + str(tmp_path / "clean"), cwd=tmp_path)
    first, second = (Path(out.stdout.split()[1].rstrip(":")) for out in (done, clean))
    for split in ("train", "val", "test"):
        assert (first / f"{split}.bin").read_bytes() == (second / f"{split}.bin").read_bytes()


@pytest.mark.slow
def test_two_jobs_preparing_one_cache_at_once_tokenize_it_once(tmp_path):
    sets = slow_corpus(tmp_path)
    procs = [start(["data", "prepare", *sets], tmp_path) for _ in range(2)]
    outs = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], outs
    said = sorted(out.split()[0] for out, _ in outs)
    assert said == ["already", "prepared"], outs
    entries = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert len(entries) == 1 and (entries[0] / "meta.json").is_file()


@pytest.mark.parametrize(
    "setup, sets, expected",
    [
        (
            None,
            ["data.files=[nothing/*.jsonl]"],
            r"data.files: 'nothing/\*.jsonl' matches no file or folder",
        ),
        ("empty.jsonl", [], r"empty.jsonl: the file holds no documents; remove it from data.files"),
        (
            "bad.jsonl",
            [],
            r"bad.jsonl:3: not valid JSON \(Expecting .*\); each line must be one JSON object",
        ),
        (
            "other.jsonl",
            [],
            r"other.jsonl:1: no field 'text' \(fields there: id, body\); set data.text_field",
        ),
        ("other.jsonl", ["data.text_field=id"], r"other.jsonl:1: field 'id' holds int, not text"),
        (
            "cols.parquet",
            [],
            r"cols.parquet: no column 'text' \(columns there: body\); set data.text_field",
        ),
        (
            "notes.csv",
            [],
            r"notes.csv is not a data file qgtrain reads; allowed: .txt, .md, .jsonl",
        ),
        (
            "ok.jsonl",
            ["data.tokenizer=tokfolder"],
            r"data.tokenizer: .*tokfolder/tokenizer.json could not be read",
        ),
        (
            "ok.jsonl",
            ["data.val_files=[empty-folder]"],
            r"data.val_files: the folder .*empty-folder holds no data",
        ),
    ],
)
def test_bad_data_gets_one_line_exit_2_and_leaves_nothing_behind(tmp_path, setup, sets, expected):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "empty.jsonl").write_text("\n\n")
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c"\n')
    (tmp_path / "other.jsonl").write_text('{"id": 1, "body": "x"}\n')
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "cols.parquet")
    (tmp_path / "notes.csv").write_text("a,b\n")
    write_jsonl(tmp_path / "ok.jsonl", documents(5, 1))
    (tmp_path / "tokfolder").mkdir()
    (tmp_path / "tokfolder" / "tokenizer.json").write_text("{not json")
    (tmp_path / "empty-folder").mkdir()
    files = [f"data.files=[{setup}]"] if setup else []
    out = cli(
        "data",
        "prepare",
        "--set",
        "data.name=files",
        "data.cache_dir=cache",
        *files,
        *sets,
        cwd=tmp_path,
    )
    assert out.returncode == 2 and out.stdout == "", out
    error = [line for line in out.stderr.splitlines() if line.startswith("qgtrain: error: ")]
    assert len(error) == 1 and "Traceback" not in out.stderr, out.stderr
    import re

    assert re.search(expected, error[0]), error[0]
    cache = tmp_path / "cache"
    assert not (cache.exists() and [p for p in cache.glob("*") if p.is_dir()]), (
        "nothing was prepared"
    )


def test_a_dataset_dict_folder_asks_for_its_split_folders(tmp_path):
    from datasets import Dataset, DatasetDict

    DatasetDict(
        {
            "train": Dataset.from_dict({"text": ["a"]}),
            "validation": Dataset.from_dict({"text": ["b"]}),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(
        ConfigError,
        match=r"holds a DatasetDict with splits train, validation; name the split "
        r"folders, e.g. data.files: \['.*dd/train'\]",
    ):
        preparing.prepare(data(tmp_path, tmp_path / "dd"))
    # No test fraction: held-out documents are drawn by a hash of their path, which holds pytest's
    # numbered temporary folder, and "a" went to the test split in about one run in twenty.
    files, _ = preparing.prepare(
        data(
            tmp_path,
            tmp_path / "dd" / "train",
            test_fraction=0.0,
            val_files=(str(tmp_path / "dd/validation"),),
        )
    )
    assert (decoded(files, "train"), decoded(files, "val")) == (["a"], ["b"])


@pytest.mark.parametrize("hidden", [False, True])
def test_one_rank_works_and_a_node_that_cannot_see_the_result_works_once_itself(tmp_path, hidden):
    results = run_ranks(2, works_once, str(tmp_path), hidden)
    workers = sorted(p.name for p in tmp_path.glob("worked-*"))
    if hidden:
        assert workers == ["worked-0", "worked-1"] and results == [
            f"{tmp_path}/result-by-0",
            f"{tmp_path}/result-by-1",
        ]
    else:
        assert workers == ["worked-0"] and results == [f"{tmp_path}/result-by-0"] * 2


def test_ranks_that_wait_past_the_limit_stop_naming_the_setting_with_a_hint(tmp_path):
    results = run_ranks(2, works_once, str(tmp_path), False, 0.3)
    assert results[1].startswith(
        "QgtrainError: waited 0 s for rank 0, which works, longer than data.prepare_timeout_s (0 s)"
    )
    assert "HINT: rank 0's log says whether it is still at work" in results[1]
    assert "longer than data.prepare_timeout_s" in results[0], (
        "rank 0 then waits for rank 1 in vain"
    )


def train_args(tmp_path: Path, run: Path) -> list[str]:
    return train_command(
        run,
        "data.name=files",
        f"data.files=[{tmp_path}/shard*.jsonl.gz]",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.max_steps=24",
        "train.log_every=1",
        "train.eval_every=8",
        "train.eval_batches=2",
        "checkpoint.every_steps=4",
        "model.hidden=64",
        "model.layers=2",
        "data.seq_len=64",
        "train.batch_size=8",
        "logging.tensorboard=false",
        "optim.warmup_steps=4",
    )


@pytest.mark.slow
def test_two_ranks_train_on_files_one_tokenizes_and_a_killed_run_resumes_bit_for_bit(tmp_path):
    for shard in range(3):
        write_jsonl(tmp_path / f"shard{shard}.jsonl.gz", documents(300, shard))
    seed = int(os.environ.get("QGTRAIN_TEST_SEED", time.time()))
    kill_at = random.Random(seed).randrange(6, 20)
    reference, run = tmp_path / "reference", tmp_path / "killed"
    assert wait_ranks(
        start_cli_ranks(2, train_args(tmp_path, reference), tmp_path, log_prefix="ref"), 300
    ) == [0, 0]
    logs = [(reference / "logs" / f"rank_{rank}.log").read_text() for rank in range(2)]
    assert "data: tokenized" in logs[0] and "data: tokeniz" not in logs[1]
    assert len([p for p in (tmp_path / "cache").iterdir() if p.is_dir()]) == 1

    procs = start_cli_ranks(2, train_args(tmp_path, run), tmp_path, log_prefix="killed")
    kill_once_saved(run, procs, kill_at)
    assert wait_ranks(
        start_cli_ranks(2, train_args(tmp_path, run), tmp_path, log_prefix="killed"), 300
    ) == [0, 0]
    assert_resumed_equals(reference, run, f"(seed {seed}: killed at step {kill_at})", 24)


@pytest.mark.slow
def test_a_run_resumed_after_its_data_changed_says_so(tmp_path):
    write_jsonl(tmp_path / "shard0.jsonl.gz", documents(200, 0))
    run = tmp_path / "run"
    args = [
        *train_args(tmp_path, run),
        "train.max_steps=4",
        "train.eval_every=0",
        "checkpoint.every_steps=2",
    ]
    assert cli(*args, cwd=tmp_path).returncode == 0
    write_jsonl(tmp_path / "shard0.jsonl.gz", documents(220, 5))
    resumed = cli(
        *args[:-3],
        "train.max_steps=6",
        "train.eval_every=0",
        "checkpoint.every_steps=2",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr
    log = (run / "logs" / "rank_0.log").read_text()
    assert (
        "resumed from" in log
        and "the data changed since checkpoint step 4: it was trained on " in log
    )
    assert log.count("the data changed") == 1
