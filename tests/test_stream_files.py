"""Data files streamed (data.stream: true) by real `qgtrain train` ranks with 2 loader workers each:
SIGKILLed at a random step and resumed bit for bit; then resumed on 1 rank (with 2 loader workers,
then 3) and again on 3 ranks, with every document one sample whose first bytes are its id, so the
ids a recording model trained on show that no sample was repeated or skipped; held-out documents
never trained on; and the bad input refused in one line (a changed file at a resume, with the
checkpoint left alone). In one process: every file kind streams the windows the cache holds, and
files cut into many shards resume from any saved state."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from qgtrain.config import DataConfig
from qgtrain.data.files import shards
from qgtrain.data.stream import filestream, heldout
from qgtrain.foundation.errors import ConfigError
from tests.helpers import (
    checkpoint_digests,
    checkpoint_state,
    cli,
    kill_once_saved,
    records,
    stream_settings,
    streamed_files,
)
from tests.ranks import start_cli_ranks, wait_ranks

FIRST, ONE, THREE = 6, 10, 14  # the last step on 2 ranks, then on 1, then on 3
BATCH = 2  # per rank: the 32 samples at step ONE do not divide by 3 ranks (no need to)


def train(run: Path, data: Path, max_steps: int) -> list[str]:
    return ["train", "--run-dir", str(run), *stream_settings(data, f"train.max_steps={max_steps}")]


def ranks(count: int, args: list[str], cwd: Path, prefix: str, ids: str = "") -> list[int]:
    env = {"QGTRAIN_TEST_IDS": str(cwd / ids)} if ids else {}
    return wait_ranks(start_cli_ranks(count, args, cwd, env, prefix), 180)


def write_documents(folder: Path) -> Path:
    """8 files of 20-41 documents, each 15 bytes + the end-of-text token = one sample of 16 tokens,
    whose first 6 bytes are its id (file and index)."""
    folder.mkdir()
    for part in range(8):
        rng = random.Random(part)
        lines = [
            json.dumps({"text": f"{part:02d}{i:04d}" + "".join(rng.choices("abcdefgh", k=9))})
            for i in range(20 + 3 * part)
        ]
        (folder / f"part-{part}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An uninterrupted 2-rank run to step FIRST; the same run SIGKILLed at a random step and
    resumed; then the uninterrupted one resumed on 1 rank, on it again with 3 loader workers to
    step ONE, and on 3 ranks to THREE."""
    tmp = tmp_path_factory.mktemp("stream-files")
    data = write_documents(tmp / "data")
    ref, killed = tmp / "ref", tmp / "killed"
    assert ranks(2, train(ref, data, FIRST), tmp, "ref", "ids-2") == [0, 0], (
        tmp / "ref-0.out"
    ).read_text()[-3000:]
    seed = int(os.environ.get("QGTRAIN_TEST_SEED", time.time()))
    kill_at = random.Random(seed).randrange(3, FIRST)
    procs = start_cli_ranks(2, train(killed, data, FIRST), tmp, log_prefix="killed")
    kill_once_saved(killed, procs, kill_at)
    assert ranks(2, train(killed, data, FIRST), tmp, "resumed") == [0, 0], (
        tmp / "resumed-0.out"
    ).read_text()[-3000:]
    assert ranks(1, train(ref, data, ONE - 2), tmp, "one", "ids-1") == [0]
    more = [*train(ref, data, ONE), "data.num_workers=3"]  # the slots change as with ranks
    assert ranks(1, more, tmp, "workers", "ids-1") == [0], (tmp / "workers-0.out").read_text()
    assert ranks(3, train(ref, data, THREE), tmp, "three", "ids-3") == [0, 0, 0], (
        tmp / "three-0.out"
    ).read_text()[-3000:]
    return {
        "tmp": tmp,
        "data": data,
        "ref": ref,
        "killed": killed,
        "context": f"(seed {seed}: killed at step {kill_at})",
    }


def trained_ids(tmp: Path) -> list[str]:
    return [line for path in sorted(tmp.glob("ids-*")) for line in path.read_text().split()]


def plan_of(data: Path) -> filestream.StreamPlan:
    return filestream.plan(streamed_files(f"{data}/part-*.jsonl"), 0)


def test_streamed_files_killed_at_a_random_step_resume_bit_for_bit(chain):
    ref, killed, context = chain["ref"], chain["killed"], chain["context"]
    expected = [r for r in records(ref) if r["step"] <= FIRST]
    got = records(killed)
    assert [r["step"] for r in got] == list(range(1, FIRST + 1)), context
    for want, have in zip(expected, got):
        assert (have["loss"], have.get("val_loss")) == (want["loss"], want.get("val_loss")), (
            f"step {want['step']} {context}"
        )
    want_state = checkpoint_state(ref / "checkpoints" / f"step-{FIRST}")
    have_state = checkpoint_state(killed / "checkpoints" / f"step-{FIRST}")
    for name, tensor in want_state.items():
        assert torch.equal(tensor, have_state[name]), f"{name} {context}"
    assert "resumed from" in (killed / "logs" / "rank_0.log").read_text(), context
    assert not list(chain["tmp"].glob("**/meta.json")), "a stream builds no cache"


def test_resumed_on_one_then_three_ranks_no_sample_is_repeated_or_skipped(chain):
    """The ids trained on, per file, are exactly the first ones of an uninterrupted read of it,
    each once: a shard is read in order, so a skipped sample would leave a gap."""
    consumed = trained_ids(chain["tmp"])
    assert len(consumed) == BATCH * (2 * FIRST + (ONE - FIRST) + 3 * (THREE - ONE))
    assert not [i for i, n in Counter(consumed).items() if n > 1], "a sample trained on twice"
    plan = plan_of(chain["data"])
    uninterrupted: dict[str, list[str]] = {}
    for index, shard in enumerate(plan.shards):
        reader = filestream.FileReader(plan, 0, 1)
        reader.queue = [[index, 0, -1, 0]]
        uninterrupted[Path(shard.source.path).stem] = [
            bytes(s[:6].tolist()).decode() for s in reader
        ]
    for stem, ids in uninterrupted.items():
        taken = sorted(i for i in consumed if f"part-{int(i[:2])}" == stem)
        assert taken == ids[: len(taken)], f"{stem}: {taken} is not the start of {ids}"
    assert [r["epoch"] for r in records(chain["ref"])][-1] == 0, "all in one epoch"
    for prefix, saved_by in (("one", 2), ("workers", 1), ("three", 1)):
        log = (chain["tmp"] / f"{prefix}-0.out").read_text()
        assert f"positions saved by {saved_by} rank(s) dealt again" in log, log[-2000:]


def test_held_out_documents_are_evaluated_and_never_trained_on(chain):
    plan = plan_of(chain["data"])
    val = heldout.held_out(
        streamed_files(f"{chain['data']}/part-*.jsonl"),
        plan,
    )["val"]
    held = {bytes(val[i][:6].tolist()).decode() for i in range(len(val))}
    assert len(held) >= 10 and not held & set(trained_ids(chain["tmp"]))
    assert records(chain["ref"])[-1]["val_loss"] is not None


def test_a_changed_file_fails_a_resume_in_one_line_and_leaves_the_checkpoint(chain, tmp_path):
    data, run = tmp_path / "data", tmp_path / "run"
    shutil.copytree(chain["data"], data)
    shutil.copytree(chain["killed"], run)
    with open(data / "part-3.jsonl", "a") as more:
        more.write(json.dumps({"text": "added later"}) + "\n")
    before = checkpoint_digests(run)
    assert ranks(1, train(run, data, FIRST + 2), tmp_path, "changed") == [2]
    last = (tmp_path / "changed-0.out").read_text().strip().splitlines()[-1]
    assert last.startswith(
        "qgtrain: error: data.files (data.stream: true): resuming the stream "
        f"from {run / 'checkpoints' / f'step-{FIRST}'} failed: ValueError: "
        "the data files or the settings"
    ), last
    assert checkpoint_digests(run) == before


def test_bad_input_is_one_line_naming_the_key(tmp_path, monkeypatch):
    out = cli(
        "train", "--run-dir", str(tmp_path / "run"), "--set", "data.stream=true", cwd=tmp_path
    )
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(
        "qgtrain: error: --set: data.stream: streams data files; set data.name: files"
    ), last
    config = DataConfig(name="files", files=(f"{tmp_path}/none-*.jsonl",), stream=True)
    with pytest.raises(ConfigError, match=r"data.files: '.*none-\*.jsonl' matches no file"):
        filestream.plan(config, 0)
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n' * 50)
    config = DataConfig(name="files", files=(f"{tmp_path}/empty.jsonl",), stream=True)
    with pytest.raises(ConfigError, match="data.files: the stream yields nothing"):
        filestream.check(filestream.plan(config, 0))
    monkeypatch.setattr(shards, "SHARD_BYTES", 64)
    with pytest.raises(ValueError, match="names a shard the data files do not have"):
        plan = filestream.plan(config, 0)
        filestream.check_state(
            plan,
            {
                "digest": plan.digest,
                "epoch": 0,
                "slot": 0,
                "slots": 1,
                "queue": [[len(plan.shards), 0, -1, 0]],
            },
        )


def write_formats(folder: Path) -> list[Path]:
    """One file of each kind, documents of random lengths (some longer than a window)."""
    import gzip

    import pyarrow
    from pyarrow import ipc, parquet

    rng = random.Random(7)
    docs = [
        " ".join(rng.choices(["shard", "token", "über", "東京", "x"], k=rng.randint(1, 40)))
        for _ in range(60)
    ]
    lines = "".join(json.dumps({"text": doc}) + "\n" for doc in docs)
    folder.mkdir()
    (folder / "a.txt").write_text("\n".join(docs))
    (folder / "b.jsonl").write_text(lines)
    (folder / "c.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (folder / "d.json").write_text(json.dumps([{"text": doc} for doc in docs]))
    table = pyarrow.table({"text": docs})
    parquet.write_table(table, folder / "e.parquet", row_group_size=16)
    with ipc.new_stream(str(folder / "f.arrow"), table.schema) as out:
        out.write_table(table, max_chunksize=16)
    return sorted(folder.iterdir())


def test_each_file_kind_streams_the_windows_the_cache_holds(tmp_path):
    """One file at a time (one shard), nothing held out: the stream's samples are the cache's
    windows of the same file, so streaming changes how text is read, not what is trained on."""
    from qgtrain.data.cache import prepare

    for path in write_formats(tmp_path / "files"):
        config = DataConfig(
            name="files",
            files=(str(path),),
            seq_len=7,
            val_fraction=0.0,
            test_fraction=0.0,
            cache_dir=str(tmp_path / "cache"),
        )
        cached = prepare.prepare(config)[0]
        tokens = np.fromfile(cached.path("train"), dtype=cached.dtype).astype(np.int64)
        windows = tokens[: len(tokens) // 7 * 7].reshape(-1, 7)
        streamed = torch.stack(list(filestream.FileReader(filestream.plan(config, 0), 0, 1)))
        assert torch.equal(streamed, torch.from_numpy(windows)), path.name


def test_a_position_anywhere_in_cut_files_resumes_the_same_samples(tmp_path, monkeypatch):
    """Plain-text and JSON Lines files cut into many shards at byte offsets, parquet at row
    groups: every document read once, and a reader put back at any saved state continues exactly
    as the uninterrupted one."""
    from pyarrow import parquet

    monkeypatch.setattr(shards, "SHARD_BYTES", 300)
    monkeypatch.setattr(shards, "UNIT_BYTES", 50)
    paths = write_formats(tmp_path / "files")
    for path in (paths[0], paths[1], paths[4]):
        config = DataConfig(
            name="files", files=(str(path),), seq_len=5, val_fraction=0.2, test_fraction=0.0
        )
        plan = filestream.plan(config, 3)
        assert len(plan.shards) > 3, path.name
        read = [unit.text for shard in plan.shards for unit in shards.units(shard, "text")]
        if path.suffix == ".txt":
            assert "".join(read) == path.read_text()
        elif path.suffix == ".parquet":
            assert read == parquet.read_table(path).column("text").to_pylist()
        else:
            assert read == [json.loads(line)["text"] for line in path.read_text().splitlines()]
        whole = list(filestream.FileReader(plan, 0, 1))
        for stop in range(0, len(whole), 37):
            reader = filestream.FileReader(plan, 0, 1)
            samples = iter(reader)
            head = [next(samples) for _ in range(stop)]
            again = filestream.FileReader(plan, 0, 1)
            again.load_state_dict(reader.state_dict())
            assert torch.equal(torch.stack(head + list(again)), torch.stack(whole)), stop
