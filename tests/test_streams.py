"""A training split that is a stream (an IterableDataset), on 2 gloo ranks with 2 loader workers
each: parts of uneven length per rank, worker and epoch, SIGKILLed at a random step and resumed,
equal to the uninterrupted run bit for bit, with and without the stream's own state; a Hugging
Face streaming dataset of local parquet files; and the streams qgtrain refuses in one line
(empty, a state that fails to load) without touching the checkpoint."""

from __future__ import annotations

import os
import random
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow
import pytest
import torch
from pyarrow import parquet

from tests.helpers import (
    assert_resumed_equals,
    checkpoint_digests,
    kill_once_saved,
    records,
    train_command,
)
from tests.ranks import start_cli_ranks, wait_ranks

MAX_STEPS = 16
SETTINGS = [
    f"train.max_steps={MAX_STEPS}",
    "train.batch_size=4",
    "data.num_workers=2",
    "train.log_every=1",
    "train.eval_every=8",
    "checkpoint.every_steps=3",
    "logging.tensorboard=false",
    "optim.warmup_steps=0",
    "optim.schedule=constant",
]


def train(task: str, run: Path, *sets: str) -> list[str]:
    return train_command(
        run,
        f"task=tests.stream_tasks:{task}",
        *SETTINGS,
        *sets,
    )


def two_ranks(args: list[str], cwd: Path, prefix: str) -> list[int]:
    return wait_ranks(start_cli_ranks(2, args, cwd, log_prefix=prefix), 180)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Each stream's uninterrupted run, trained once."""
    made: dict[str, Path] = {}

    def run_for(task: str) -> Path:
        if task not in made:
            tmp = tmp_path_factory.mktemp(f"uninterrupted-{task}")
            assert two_ranks(train(task, tmp / "run"), tmp, "ref") == [0, 0], (
                tmp / "ref-0.out"
            ).read_text()
            made[task] = tmp / "run"
        return made[task]

    return run_for


@pytest.mark.parametrize("task", ["stateful", "stateless"])
def test_a_stream_killed_at_a_random_step_resumes_bit_for_bit(tmp_path, uninterrupted, task):
    seed = int(os.environ.get("QGTRAIN_TEST_SEED", time.time()))
    kill_at = random.Random(seed).randrange(4, MAX_STEPS - 2)
    reference, run = uninterrupted(task), tmp_path / "killed"
    epochs = [r["epoch"] for r in records(reference)]
    assert epochs[-1] >= 2 and epochs[4:6] == [0, 1], "uneven parts: epoch 0 is rank 0's 5 steps"
    args = train(task, run)
    procs = start_cli_ranks(2, args, tmp_path, log_prefix="killed")
    kill_once_saved(run, procs, kill_at)
    assert two_ranks(args, tmp_path, "resumed") == [0, 0], (tmp_path / "resumed-0.out").read_text()
    context = f"(seed {seed}: killed at step {kill_at})"
    assert_resumed_equals(reference, run, context)
    logs = [(run / "logs" / f"rank_{rank}.log").read_text() for rank in (0, 1)]
    skipped = [
        re.findall(r"skipped (\d+) samples of the stream in ([\d.]+) s", log) for log in logs
    ]
    if task == "stateless":  # rank 1's part is longer, but both consumed the same count in lockstep
        assert skipped[0] and skipped[0][-1][0] == skipped[1][-1][0], f"{skipped} {context}"
    else:
        assert skipped == [[], []], "a stateful stream resumes from its state, not by reading again"
    assert "resumed from" in logs[0], context


def test_a_hugging_face_stream_of_parquet_files_trains_on_two_ranks_and_resumes(tmp_path):
    """Four files of uneven length, split by node (two shards a rank) and by worker (one each);
    the run resumed from its step-9 checkpoint (its later ones removed) ends as the uninterrupted
    one."""
    files = []
    for shard, rows in enumerate((9, 13, 11, 17)):
        g = torch.Generator().manual_seed(shard)
        xs = torch.randn(rows, 8, generator=g)
        table = pyarrow.table({"x": xs.tolist(), "label": (xs[:, :3].sum(1) > 0).long().tolist()})
        files.append(tmp_path / f"part-{shard}.parquet")
        parquet.write_table(table, files[-1])
    hub = ["task.options.files=" + ",".join(map(str, files)), "checkpoint.keep_last=8"]
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    args = train("hub_parquet", tmp_path / "run", *hub)
    assert wait_ranks(start_cli_ranks(2, args, tmp_path, env, "ref"), 180) == [0, 0], (
        tmp_path / "ref-0.out"
    ).read_text()[-3000:]
    run = tmp_path / "resumed"
    shutil.copytree(tmp_path / "run", run)
    for later in (run / "checkpoints").glob("step-*"):
        if int(later.name.split("-")[1]) > 9:
            shutil.rmtree(later)
    args = train("hub_parquet", run, *hub)
    assert wait_ranks(start_cli_ranks(2, args, tmp_path, env, "resumed"), 180) == [0, 0]
    assert "resumed from" in (run / "logs" / "rank_0.log").read_text().split("step 9/")[-1]
    assert_resumed_equals(tmp_path / "run", run, "(resumed at step 9)")
    assert records(run)[-1]["epoch"] >= 1


def test_an_empty_stream_is_one_line_naming_the_train_split(tmp_path):
    assert two_ranks(train("empty", tmp_path / "run"), tmp_path, "empty") == [2, 2]
    last = (tmp_path / "empty-0.out").read_text().strip().splitlines()[-1]
    assert last.startswith(
        "qgtrain: error: task.factory: the train split of "
        "tests.stream_tasks:empty: the stream ended before the first step of "
        "epoch 0"
    ), last


def test_a_state_that_fails_to_load_is_one_line_and_leaves_the_checkpoint_alone(
    tmp_path, uninterrupted
):
    run = tmp_path / "run"
    shutil.copytree(uninterrupted("stateful"), run)
    before = checkpoint_digests(run)
    args = train("broken_state", run, f"train.max_steps={MAX_STEPS + 4}")
    assert two_ranks(args, tmp_path, "broken") == [2, 2]
    last = (tmp_path / "broken-1.out").read_text().strip().splitlines()[-1]
    saved = run / "checkpoints" / f"step-{MAX_STEPS}"
    assert last.startswith(
        "qgtrain: error: task.factory: the train split of "
        "tests.stream_tasks:broken_state: resuming the stream from "
        f"{saved} failed: "
        "ValueError: no shard for position"
    ), last
    assert "The checkpoint is unchanged" in last
    assert checkpoint_digests(run) == before
