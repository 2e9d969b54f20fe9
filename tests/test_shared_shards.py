"""A streamed source with fewer shards than reading slots (a small curated file beside a corpus, at
any world size): the slots share its shards, each taking every n-th line or row. In one process:
every document read once a pass by the slots together, any saved position resumed exactly, the
positions of sharing slots dealt again to another count of slots, the cut logged in one line; a
part too small for a window, and a file of zero bytes, refused in one line naming the file. The
runs of real ranks are test_mix.py's streamed mixture (a one-file source on 2 ranks x 2 workers)
and test_stream_files.py's chain (a resume with another data.num_workers)."""

from __future__ import annotations

import gzip
import json
import logging
import random
from collections import Counter
from pathlib import Path

import pytest
import torch

from qgtrain.config import DataConfig
from qgtrain.data.stream import filestream
from qgtrain.foundation.errors import ConfigError


def write_ids(folder: Path, count: int) -> list[Path]:
    """One file of each kind a shard is read from differently (seekable lines, a plain-text file,
    a compressed one, parquet rows), each document 15 bytes whose first 6 are its id: with the
    end-of-text token (a newline in the plain-text file) one window of 16 tokens."""
    from pyarrow import parquet, table

    rng = random.Random(count)
    docs = [f"{i:06d}" + "".join(rng.choices("abcdefgh", k=9)) for i in range(count)]
    lines = "".join(json.dumps({"text": doc}) + "\n" for doc in docs)
    folder.mkdir()
    (folder / "a.jsonl").write_text(lines)
    (folder / "b.txt").write_text("".join(doc + "\n" for doc in docs))
    (folder / "c.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    parquet.write_table(table({"text": docs}), folder / "d.parquet", row_group_size=16)
    return sorted(folder.iterdir())


def plan_of(path: Path) -> filestream.StreamPlan:
    config = DataConfig(
        name="files", files=(str(path),), seq_len=16, val_fraction=0.0, test_fraction=0.0
    )
    return filestream.plan(config, 5, f"data.files ({path.name})")  # the key names the file


def ids(samples: list[torch.Tensor]) -> list[str]:
    return [bytes(sample[:6].tolist()).decode() for sample in samples]


def test_slots_sharing_one_file_read_each_document_once_and_resume_anywhere(tmp_path):
    paths = write_ids(tmp_path / "files", 40)
    plan = plan_of(tmp_path / "files" / "*")
    for epoch in range(3):  # 4 shards for 5 slots: one of them (another each pass) read by 2
        read = [ids(list(filestream.FileReader(plan, slot, 5, epoch))) for slot in range(5)]
        assert Counter(i for part in read for i in part) == {f"{i:06d}": 4 for i in range(40)}
    for path in paths:
        plan = plan_of(path)
        assert len(plan.shards) == 1, path.name
        parts = [list(filestream.FileReader(plan, slot, 3)) for slot in range(3)]
        read = [i for part in parts for i in ids(part)]
        assert sorted(read) == [f"{i:06d}" for i in range(40)], path.name
        assert all(13 <= len(part) <= 14 for part in parts), path.name
        for stop in range(len(parts[1]) + 1):
            reader = filestream.FileReader(plan, 1, 3)
            samples = iter(reader)
            head = [next(samples) for _ in range(stop)]
            again = filestream.FileReader(plan, 0, 1)
            again.load_state_dict(reader.state_dict())
            assert torch.equal(torch.stack(head + list(again)), torch.stack(parts[1])), stop


def test_positions_of_sharing_slots_are_dealt_again_to_another_count_of_slots(tmp_path):
    """3 slots sharing a file stop after 2, 0 and 5 samples; one slot takes all their positions
    over and reads every other document once. A position saved before shards were shared (4
    numbers an entry) is the whole shard."""
    plan = plan_of(write_ids(tmp_path / "files", 30)[0])
    readers = [filestream.FileReader(plan, slot, 3) for slot in range(3)]
    head: list[torch.Tensor] = []
    for reader, n in zip(readers, (2, 0, 5)):
        samples = iter(reader)
        head += [next(samples) for _ in range(n)]
    stream = filestream.FileStream(plan)
    stream.load_merged([reader.state_dict() for reader in readers])
    rest = list(stream.reader())
    assert sorted(ids(head + rest)) == [f"{i:06d}" for i in range(30)]
    old = filestream.FileReader(plan, 0, 1)
    old.load_state_dict({**old.state_dict(), "queue": [[0, 0, -1, 0]]})
    assert len(list(old)) == 30


def test_a_shared_source_is_logged_and_a_part_without_a_window_or_an_empty_file_refused(
    tmp_path, caplog
):
    big, small = write_ids(tmp_path / "big", 40)[0], write_ids(tmp_path / "small", 3)[0]
    with caplog.at_level(logging.INFO, logger="qgtrain"):
        filestream.check(plan_of(big), 2, 4)
    assert (
        "data.files (a.jsonl): 1 shard(s) for 4 reading slots (2 rank(s) x 2 loader worker(s)): "
        "each shard is read by 4 slots together, slot k of n taking its units (lines, rows) k, "
        "k+n, ..."
    ) in caplog.messages
    with pytest.raises(ConfigError, match=rf"^data.files \(a.jsonl\): {small} is read by 4 of "):
        filestream.check(plan_of(small), 2, 4)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"empty.jsonl: the file is empty \(0 bytes\); remove"):
        plan_of(tmp_path / "empty.jsonl")
