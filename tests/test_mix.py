"""data.mix on 2 gloo ranks with 2 loader workers each (4 reading slots): the shares of the sources
within 0.05 of their weights and reported as samples_<name>, a small source starting its next
pass, a run SIGKILLed at a random step resumed bit for bit (losses, counts, weights), and the
mixtures qgtrain refuses in one line. data.dispatch: rank 0 reads and each rank gets its own
batches across an epoch's end; a dispatched mixture killed and resumed bit for bit. With
data.stream a mixture of streamed sources (web in 4 files, code 3:1 in one file the 4 slots share
by a stride of lines; no cache written): its shares, a source's next pass, a SIGKILL resumed bit
for bit, a source of zero bytes refused naming the file. On another world size a cached mixture is
refused in one line; a dispatched stream and a dispatched mixture go on (rank 0 holds the whole
stream); a streamed mixture's resize is tests/test_mix_resize.py's."""

from __future__ import annotations

import dataclasses
import os
import random
import re
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import IterableDataset

from qgtrain.config import DataConfig
from qgtrain.config.load import load_config
from qgtrain.data.loaders import stream_loader
from qgtrain.data.mixture.cached import CachedReader
from qgtrain.data.mixture.mix import Mixture, Source, bounds, choose
from qgtrain.data.stream.dispatch import DispatchedBatches
from qgtrain.data.tokens import TokenWindows
from qgtrain.foundation.errors import ConfigError
from qgtrain.tasks.mixture import streamed_splits
from tests.helpers import (
    assert_resumed_equals,
    cli,
    kill_once_saved,
    mix_setting,
    records,
    train_command,
    write_mix_source,
)
from tests.ranks import run_ranks, start_cli_ranks, wait_ranks

MAX_STEPS = 16


# Which documents are held out is drawn from each file's path, so the sources' few documents (about
# 130) must hold out a window for each split in whatever folder pytest makes: with the default 0.05
# one run in 700 held out none for validation and was refused; with 0.1 one in 800,000.
HELD_OUT = ("data.val_fraction=0.1", "data.test_fraction=0.1")


def train(folder: Path, run: Path, *sets: str) -> list[str]:
    return train_command(
        run,
        "data.name=files",
        mix_setting(folder),
        f"data.cache_dir={folder / 'cache'}",
        *HELD_OUT,
        f"train.max_steps={MAX_STEPS}",
        "train.batch_size=4",
        "data.num_workers=2",
        "data.seq_len=32",
        "model.hidden=32",
        "model.layers=2",
        "train.log_every=1",
        "train.eval_every=8",
        "train.eval_batches=2",
        "checkpoint.every_steps=3",
        "logging.tensorboard=false",
        "optim.warmup_steps=2",
        *sets,
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """web: about 60 windows per slot, never exhausted; code: 4 or 5 per slot, read about 3 times;
    both prepared by `qgtrain data prepare`."""
    folder = tmp_path_factory.mktemp("mix")
    write_mix_source(folder / "web.jsonl", 120, 1)
    write_mix_source(folder / "code.jsonl", 9, 2)
    prepared = cli(
        "data",
        "prepare",
        "--set",
        "data.name=files",
        mix_setting(folder),
        f"data.cache_dir={folder / 'cache'}",
        *HELD_OUT,
        cwd=folder,
    )
    lines = prepared.stdout.splitlines()
    assert [line.split(" (")[-1] for line in lines] == [
        "data.mix source web)",
        "data.mix source code)",
    ], prepared
    return folder


@pytest.fixture(scope="module")
def uninterrupted(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    codes = wait_ranks(start_cli_ranks(2, train(data, tmp / "run"), tmp, log_prefix="ref"), 240)
    assert codes == [0, 0], (tmp / "ref-0.out").read_text()[-3000:]
    return tmp / "run"


def test_two_ranks_two_workers_draw_each_source_by_its_weight_and_restart_the_small_one(
    uninterrupted,
):
    got = records(uninterrupted)
    assert [r["step"] for r in got] == list(range(1, MAX_STEPS + 1))
    for record in got:  # every sample of every rank counted once, as of that step
        assert record["samples_web"] + record["samples_code"] == record["step"] * 2 * 4, record
    last = got[-1]
    share = last["samples_code"] / (MAX_STEPS * 8)
    assert abs(share - 3 / 9) <= 0.05, last
    assert "val_loss" in last and "test_loss" in last and last["epoch"] == 0
    logs = [(uninterrupted / "logs" / f"rank_{rank}.log").read_text() for rank in (0, 1)]
    assert "tokeniz" not in logs[0], "`qgtrain data prepare` prepared the sources the run reads"
    passes = [
        re.findall(
            r"data.mix: source '(\w+)' ran out in reading slot (\d) of 4 after "
            r"(\d+) of its samples: starting its pass (\d)",
            log,
        )
        for log in logs
    ]
    slots = {(slot, int(nth)) for found in passes for name, slot, _, nth in found}
    assert {name for found in passes for name, *_ in found} == {"code"}, passes
    assert {(slot, 2) for slot in "0123"} <= slots, f"every slot read code again: {passes}"


def killed_and_resumed(args: list[str], run: Path, tmp_path: Path) -> str:
    """The run of `args` SIGKILLed at a random step and resumed; the context for messages."""
    seed = int(os.environ.get("QGTRAIN_TEST_SEED", time.time()))
    kill_at = random.Random(seed).randrange(4, MAX_STEPS - 2)
    procs = start_cli_ranks(2, args, tmp_path, log_prefix="killed")
    kill_once_saved(run, procs, kill_at)
    codes = wait_ranks(start_cli_ranks(2, args, tmp_path, log_prefix="resumed"), 240)
    assert codes == [0, 0], (tmp_path / "resumed-0.out").read_text()[-3000:]
    return f"(seed {seed}: killed at step {kill_at})"


def test_a_mixture_killed_at_a_random_step_resumes_bit_for_bit(data, uninterrupted, tmp_path):
    run = tmp_path / "killed"
    context = killed_and_resumed(train(data, run), run, tmp_path)
    assert_resumed_equals(uninterrupted, run, context)
    counts = [
        [(r["samples_web"], r["samples_code"]) for r in records(path)]
        for path in (uninterrupted, run)
    ]
    assert counts[0] == counts[1], context
    assert "resumed from" in (run / "logs" / "rank_0.log").read_text(), context
    alone = cli(*train(data, run, f"checkpoint.resume={run}/checkpoints/step-15"), cwd=tmp_path)
    line = alone.stderr.strip().splitlines()[-1]
    assert alone.returncode == 2 and "Traceback" not in alone.stderr, alone.stderr[-3000:]
    assert re.fullmatch(
        r"qgtrain: error: data.mix: resuming the stream from .*step-\d+ failed: ValueError: a "
        r"cached source's position .* not dealt again to another world size\. The checkpoint is "
        r"unchanged\. HINT: .*",
        line,
    ), line


@pytest.mark.parametrize(
    "sources, expected",
    [
        (
            "[{name: a, files: [x], weight: 0}]",
            r"data.mix\[0\].weight: source 'a' has weight 0; weights are positive numbers",
        ),
        (
            "[{name: a, files: [x], weight: 1}, {name: b, files: [y], weight: -2}]",
            r"data.mix\[1\].weight: source 'b' has weight -2; weights are positive",
        ),
        (
            "[{name: a, files: [x], weight: 1}, {name: a, files: [y], weight: 1}]",
            r"data.mix\[1\].name: source 'a' is named twice",
        ),
        (
            "[{name: a, files: [], weight: 1}]",
            r"data.mix\[0\].files: source 'a': expected a non-empty list",
        ),
        (
            "[{name: a, file: [x], weight: 1}]",
            r"data.mix\[0\]: each source is \{name, files, weight\}, got "
            r"\['file', 'name', 'weight'\]",
        ),
    ],
)
def test_a_bad_mixture_is_one_line_naming_the_source(sources, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config([], ["data.name=files", f"data.mix={sources}"])


def test_a_mixture_of_what_is_not_files_or_a_source_matching_nothing_exits_2_in_one_line(
    data, tmp_path
):
    synthetic = cli(
        *train_command(tmp_path / "a", "data.name=synthetic", mix_setting(data)),
        cwd=tmp_path,
    )
    missing = cli(
        *train(data, tmp_path / "b", "data.num_workers=0"),
        "--set",
        mix_setting(data, code=str(tmp_path / "nothing*.jsonl")),
        cwd=tmp_path,
    )
    streamed = cli(
        *train(data, tmp_path / "c", "data.num_workers=0", "data.stream=true"),
        "--set",
        mix_setting(data, code=str(tmp_path / "nothing*.jsonl")),
        cwd=tmp_path,
    )
    lines = []
    for out in (synthetic, missing, streamed):
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        lines.append(out.stderr.strip().splitlines()[-1])
    assert re.fullmatch(
        r"qgtrain: error: .*data.mix: mixes data files; set data.name: files "
        r"\(data.name is synthetic\)",
        lines[0],
    ), lines[0]
    for line in lines[1:]:  # cached and streamed
        assert re.fullmatch(
            r"qgtrain: error: data.mix\[1\].files \(source 'code'\): "
            r"'.*nothing\*.jsonl' matches no file or folder",
            line,
        ), line


def test_data_info_shows_each_source_its_weight_and_files_then_the_caches(data, tmp_path):
    shown = cli(
        "data",
        "info",
        "--set",
        "data.name=files",
        mix_setting(data),
        f"data.cache_dir={data / 'cache'}",
        cwd=tmp_path,
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[:3] == [
        "data.mix: 2 sources, tokenized into the cache",
        "  web: weight 6 (67%), 1 file(s) (web.jsonl)",
        "  code: weight 3 (33%), 1 file(s) (code.jsonl)",
    ]
    assert sum(line.startswith(str(data / "cache")) for line in lines) == 2  # both prepared
    streamed = cli(
        "data",
        "info",
        "--set",
        "data.name=files",
        "data.stream=true",
        mix_setting(data, code=str(tmp_path / "none*.jsonl")),
        f"data.cache_dir={tmp_path / 'never'}",
        cwd=tmp_path,
    )
    assert streamed.returncode == 2 and streamed.stderr.strip().splitlines() == [
        f"qgtrain: error: data.mix[1].files (source 'code'): '{tmp_path}/none*.jsonl' matches no "
        "file or folder"
    ]


def test_a_cached_source_gives_each_slot_its_share_of_every_pass_in_a_new_order(tmp_path):
    """40 windows whose first token names them, read by 3 slots: each pass every window once, the
    next pass in another order, and a slot put back mid-pass from its state reads on as before."""
    path = tmp_path / "train.bin"
    np.arange(40 * 4, dtype=np.uint16).tofile(path)
    windows = TokenWindows(str(path), "uint16", 4)

    def read(reader: CachedReader) -> list[int]:
        return [int(window[0]) // 4 for window in reader]

    readers = [CachedReader(windows, 7, slot, 3) for slot in range(3)]
    first = [read(reader) for reader in readers]
    for reader in readers:
        reader.next_pass()
    second = [read(reader) for reader in readers]
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(40))
    assert first != second and [len(share) for share in first] == [14, 13, 13]
    reader = CachedReader(windows, 7, 1, 3)
    reader.next_pass()
    taken = iter(reader)
    head = [int(next(taken)[0]) // 4 for _ in range(5)]
    again = CachedReader(windows, 7, 1, 3)
    again.load_state_dict(reader.state_dict())
    assert head + read(again) == second[1]


def test_the_choice_meets_the_weights_within_a_sample_or_two_and_a_renamed_mix_is_refused():
    ends = bounds([1.0, 1.0, 2.0])
    for phase in (0, 12345, 2**63 + 7):
        drawn = [choose(phase, draw, ends) for draw in range(1000)]
        assert all(
            abs(drawn.count(k) - 1000 * share) <= 2 for k, share in enumerate((0.25, 0.25, 0.5))
        ), [drawn.count(k) for k in range(3)]
    mixture = Mixture([Source("web", 1.0, print), Source("code", 1.0, print)], 0, 0, 1)
    with pytest.raises(
        ValueError, match="the checkpoint mixes the sources web, math; data.mix now names web, code"
    ):
        mixture.load_state_dict({**mixture.state_dict(), "names": ["web", "math"]})


class Counting(IterableDataset):
    """0..9 whole: a stream that cannot be split over ranks."""

    def __iter__(self):  # type: ignore[no-untyped-def]
        yield from range(10)


def dispatched_rank() -> tuple[list, dict, int, bool]:  # type: ignore[type-arg]
    dist.init_process_group("gloo")
    loader = stream_loader(Counting(), 2, 0, torch.device("cpu"), 0, None)
    batches = DispatchedBatches(loader, 2 * 2, 0, "counting", dist.new_group(backend="gloo"))
    position = SimpleNamespace(epoch=0, samples_in_epoch=0)
    taken = []
    for _ in range(4):
        drawn = batches.step(position, 1)
        taken.append(
            ([batch.tolist() for batch in drawn], position.epoch, position.samples_in_epoch)
        )
    result = taken, batches.saved(), batches.between((0, 4), (1, 4)), loader._iterator is None
    dist.destroy_process_group()
    return result


def test_dispatch_sends_each_rank_its_own_batches_and_the_position_across_an_epoch_end():
    """Batches of 2, 2 ranks: a step takes 4 of the 10; the third finds 2 left, so epoch 1 starts
    on every rank at once."""
    (taken0, saved0, between0, _), (taken1, saved1, between1, idle1) = run_ranks(2, dispatched_rank)
    positions = [(0, 4), (0, 8), (1, 4), (1, 8)]
    assert taken0 == [
        ([batch], *at) for batch, at in zip([[0, 1], [4, 5], [0, 1], [4, 5]], positions)
    ]
    assert taken1 == [
        ([batch], *at) for batch, at in zip([[2, 3], [6, 7], [2, 3], [6, 7]], positions)
    ]
    assert saved0["dispatched"] and "consumed" in saved0 and saved1 == {"dispatched": True}
    assert between0 == between1 == 2 and idle1, "rank 1 never starts its loader"
    # on 1 rank: rank 0's file holds the whole stream; the run's position, (1, 8), goes on
    loader = stream_loader(Counting(), 2, 0, torch.device("cpu"), 0, None)
    alone = DispatchedBatches(loader, 2, 0, "counting", None)
    alone.restore({"ranks": [saved0, saved1]}, Path("step-4"))
    position = SimpleNamespace(epoch=1, samples_in_epoch=8)
    assert [batch.tolist() for batch in alone.step(position, 1)] == [[8, 9]]
    assert (position.epoch, position.samples_in_epoch) == (1, 10)


def test_a_dispatched_mixture_reads_on_rank_0_and_resumes_bit_for_bit(data, tmp_path):
    reference, run = tmp_path / "reference", tmp_path / "killed"
    codes = wait_ranks(
        start_cli_ranks(
            2, train(data, reference, "data.dispatch=true"), tmp_path, log_prefix="ref"
        ),
        240,
    )
    assert codes == [0, 0], (tmp_path / "ref-0.out").read_text()[-3000:]
    context = killed_and_resumed(train(data, run, "data.dispatch=true"), run, tmp_path)
    assert_resumed_equals(reference, run, context)
    got = records(run)
    assert [(r["samples_web"], r["samples_code"]) for r in got] == [
        (r["samples_web"], r["samples_code"]) for r in records(reference)
    ], context
    assert all(r["samples_web"] + r["samples_code"] == r["step"] * 8 for r in got), got
    assert abs(got[-1]["samples_code"] / (MAX_STEPS * 8) - 3 / 9) <= 0.05, got[-1]
    logs = [(reference / "logs" / f"rank_{rank}.log").read_text() for rank in (0, 1)]
    assert "ran out in reading slot 1 of 2" in logs[0] and "data.mix" not in logs[1]
    step_15 = f"checkpoint.resume={run}/checkpoints/step-15"  # on 1 rank, its last step
    alone = cli(*train(data, run, "data.dispatch=true", step_15), cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr[-3000:]
    last = records(run)[-1]
    assert last["step"] == MAX_STEPS, last
    assert last["samples_web"] + last["samples_code"] == 15 * 8 + 4, last


@pytest.fixture(scope="module")
def streamed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[str]]:
    """The mixture streamed: web in 4 files of 30 documents, code 3:1 in one file of 16 short ones
    (one shard: each of the 4 slots reads every 4th line, 3 to 5 windows, so each reads it twice);
    the `qgtrain train` arguments, and their run."""
    folder = tmp_path_factory.mktemp("streamed")
    for part in range(4):
        write_mix_source(folder / f"web-{part}.jsonl", 30, 10 + part)
    write_mix_source(folder / "code.jsonl", 16, 20, length=(4, 8))
    sources = mix_setting(folder, web=f"{folder}/web-*.jsonl", weights="3, 1")
    args = train(folder, folder / "run", "data.stream=true", "data.test_fraction=0", sources)
    codes = wait_ranks(start_cli_ranks(2, args, folder, log_prefix="ref"), 240)
    assert codes == [0, 0], (folder / "ref-0.out").read_text()[-3000:]
    return folder, args


def test_a_streamed_mixture_draws_by_weight_restarts_a_source_and_caches_nothing(streamed):
    folder, _ = streamed
    got = records(folder / "run")
    assert [r["step"] for r in got] == list(range(1, MAX_STEPS + 1))
    assert all(r["samples_web"] + r["samples_code"] == r["step"] * 8 for r in got), got
    assert abs(got[-1]["samples_code"] / (MAX_STEPS * 8) - 1 / 4) <= 0.05, got[-1]
    assert "val_loss" in got[-1]
    assert not list(folder.rglob("meta.json")), "a streamed source is tokenized into no cache"
    logs = [(folder / "run" / "logs" / f"rank_{rank}.log").read_text() for rank in (0, 1)]
    passes = {
        (slot, int(nth))
        for log in logs
        for slot, nth in re.findall(
            r"data.mix: source 'code' ran out in reading slot (\d) of 4 after \d+ of its samples: "
            r"starting its pass (\d)",
            log,
        )
    }
    assert {(slot, 2) for slot in "0123"} <= passes, passes
    assert "source 'web' ran out" not in "".join(logs)
    cut = "(source 'code'): 1 shard(s) for 4 reading slots (2 rank(s) x 2 loader worker(s))"
    assert cut in logs[0], "how the one-file source is read is logged"


def test_a_streamed_mixture_killed_at_a_random_step_resumes_bit_for_bit(streamed, tmp_path):
    folder, args = streamed
    run = tmp_path / "killed"
    killed = [str(run) if arg == str(folder / "run") else arg for arg in args]
    context = killed_and_resumed(killed, run, tmp_path)
    assert_resumed_equals(folder / "run", run, context)
    assert [(r["samples_web"], r["samples_code"]) for r in records(run)] == [
        (r["samples_web"], r["samples_code"]) for r in records(folder / "run")
    ], context
    assert "resumed from" in (run / "logs" / "rank_0.log").read_text(), context


def test_a_one_file_source_is_shared_by_the_slots_and_one_of_zero_bytes_refused(tmp_path):
    write_mix_source(tmp_path / "code.jsonl", 30, 2)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    for part in range(2):
        write_mix_source(tmp_path / f"web-{part}.jsonl", 30, part)
    data = DataConfig(
        name="files",
        stream=True,
        num_workers=2,
        seq_len=32,
        val_fraction=0.2,  # 90 documents: none held out for validation in 1 folder in 500 million
        mix=(
            {"name": "web", "files": [f"{tmp_path}/web-*.jsonl"], "weight": 1},
            {"name": "code", "files": [f"{tmp_path}/code.jsonl"], "weight": 1},
        ),
    )
    code = streamed_splits(data, 0)[0].sources[1]
    assert all(next(iter(code.reader(slot, 2)), None) is not None for slot in (0, 1))
    empty = ({**data.mix[1], "files": [f"{tmp_path}/empty.jsonl"]},)
    with pytest.raises(
        ConfigError,
        match=rf"^{tmp_path}/empty.jsonl: the file is empty \(0 bytes\); remove it from "
        r"data.mix\[1\].files \(source 'code'\)$",
    ):
        streamed_splits(dataclasses.replace(data, mix=data.mix[:1] + empty), 0)
