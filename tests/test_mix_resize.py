"""A streamed mixture (data.mix with data.stream) resumed on another world size: its slots'
positions merged and dealt again (data/mixture/merge.py). In one process: slots left at
different passes of a small source, merged from 2 slots to 3 and then to 1, read every window of
every pass once. With real `qgtrain train` ranks (2 loader workers each): SIGKILLed on 2 ranks,
resumed on 3 and then on 1, every sample id trained on once, each file's ids the start of its own
read."""

from __future__ import annotations

import functools
import json
import os
import random
import re
import time
from collections import Counter
from pathlib import Path
from typing import Any

from qgtrain.data.mixture.mix import Mixture, Source
from qgtrain.data.stream import filestream
from tests.helpers import kill_once_saved, records, stream_settings, streamed_files
from tests.ranks import start_cli_ranks, wait_ranks

FIRST, THREE, ONE = 6, 8, 10  # the last step on 2 ranks (killed before it), then on 3, then on 1
BATCH = 2


def write_mix_source(folder: Path, name: str, files: int, documents: int) -> None:
    """`files` files of `documents` documents, each 15 bytes + the end-of-text token = one sample
    of 16 tokens whose first 6 bytes are its id: source letter, file, index."""
    for part in range(files):
        rng = random.Random(f"{name}{part}")
        lines = [
            json.dumps({"text": f"{name[0]}{part}{i:04d}" + "".join(rng.choices("abcdefgh", k=9))})
            for i in range(documents + 2 * part)
        ]
        (folder / f"{name}-{part}.jsonl").write_text("\n".join(lines) + "\n")


def plans(folder: Path) -> list[filestream.StreamPlan]:
    return [
        filestream.plan(streamed_files(f"{folder}/{name}-*.jsonl", val_fraction=0.0), seed)
        for seed, name in ((1, "web"), (2, "code"))
    ]


def mixtures(folder: Path, world: int) -> list[Mixture]:
    sources = [
        Source(name, weight, functools.partial(filestream.slot_reader, plan))
        for name, weight, plan in zip(("web", "code"), (1.0, 3.0), plans(folder))
    ]
    return [Mixture(sources, 0, rank, world) for rank in range(world)]


def read(mixture: Mixture, count: int, seen: Counter[tuple[str, int, str]]) -> dict[str, Any]:
    """`count` samples of the slot, each counted under (source, pass, id); its state after."""
    samples = iter(mixture)
    for _ in range(count):
        sample = next(samples)
        state = mixture.state_dict()
        sample_id = bytes(sample[:6].tolist()).decode()
        source = 0 if sample_id[0] == "w" else 1
        seen[(sample_id[0], int(state["readers"][source]["epoch"]), sample_id)] += 1
    return mixture.state_dict()


def test_slots_at_different_passes_merged_to_three_then_one_read_every_window_once(tmp_path):
    """code (weight 3) has 4 files of 3-9 windows: the slots run through it at their own pace and
    sit at different passes, with carried passes after the first merge."""
    write_mix_source(tmp_path, "web", 4, 30)
    write_mix_source(tmp_path, "code", 4, 3)
    seen: Counter[tuple[str, int, str]] = Counter()
    states = [read(m, n, seen) for m, n in zip(mixtures(tmp_path, 2), (20, 40))]
    passes = [int(s["readers"][1]["epoch"]) for s in states]
    assert passes[0] != passes[1], f"the slots should be at different passes: {passes}"
    after, started = [], []
    for mixture, count in zip(mixtures(tmp_path, 3), (3, 30, 2)):
        mixture.load_merged(states)
        started.append(mixture.state_dict())  # a worker's state before it reads
        after.append(read(mixture, count, seen))
    assert all(s["later"][1] for s in started), "the merge carries code's pass 2 to every slot"
    assert any(s.get("later") for s in after), "a slot left with a carried pass: merged again"
    (last,) = mixtures(tmp_path, 1)
    last.load_merged(after)
    final = read(last, 60, seen)
    assert not [key for key, n in seen.items() if n > 1], "a window read twice in one pass"
    whole = {
        (name[0], bytes(s[:6].tolist()).decode())
        for name, plan in zip(("web", "code"), plans(tmp_path))
        for s in filestream.FileReader(plan, 0, 1)
    }
    # one slot holds all that was left: every pass of code before the one it is in was read whole
    code_done = int(final["readers"][1]["epoch"])
    assert code_done >= 3, final["readers"][1]
    for nth in range(code_done):
        got = {(k[0], k[2]) for k in seen if k[0] == "c" and k[1] == nth}
        assert got == {w for w in whole if w[0] == "c"}, f"pass {nth} of code"
    drawn = 20 + 40 + 3 + 30 + 2 + 60
    assert sum(final["counts"]) == drawn == sum(seen.values())
    assert abs(final["counts"][1] - drawn * 3 / 4) <= 4, final["counts"]


def train(data: Path, run: Path, max_steps: int) -> list[str]:
    """A tiny recording model on web and code at 2:1, 2 loader workers a rank, a checkpoint every
    2 steps."""
    sources = (
        f"data.mix=[{{name: web, files: ['{data}/web-*.jsonl'], weight: 2}}, "
        f"{{name: code, files: ['{data}/code-*.jsonl'], weight: 1}}]"
    )
    more = [
        arg
        for arg in stream_settings(data)
        if not arg.startswith(("data.files", "data.val_fraction"))
    ]
    return [
        "train",
        "--run-dir",
        str(run),
        *more,
        sources,
        "data.val_fraction=0",
        f"train.max_steps={max_steps}",
    ]


def ranks(count: int, args: list[str], cwd: Path, prefix: str) -> list[int]:
    env = {"QGTRAIN_TEST_IDS": str(cwd / f"ids-{prefix}")}
    return wait_ranks(start_cli_ranks(count, args, cwd, env, prefix), 180)


def test_a_streamed_mixture_killed_on_2_ranks_resumes_on_3_then_1_training_each_sample_once(
    tmp_path,
):
    """6 files a source (a shard for each of 3 ranks x 2 workers). Of the killed run, the samples
    of the steps its last checkpoint holds count; the ids trained on are then each once, and per
    file the start of its own uninterrupted read (a shard is read in order: a skip leaves a gap)."""
    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    write_mix_source(data, "web", 6, 12)
    write_mix_source(data, "code", 6, 8)
    seed = int(os.environ.get("QGTRAIN_TEST_SEED", time.time()))
    kill_at = random.Random(seed).randrange(3, FIRST)
    env = {"QGTRAIN_TEST_IDS": str(tmp_path / "ids-killed")}
    procs = start_cli_ranks(2, train(data, run, FIRST), tmp_path, env, "killed")
    kill_once_saved(run, procs, kill_at)
    context = f"(seed {seed}: killed at step {kill_at})"
    assert ranks(3, train(data, run, THREE), tmp_path, "three") == [0, 0, 0], (
        tmp_path / "three-0.out"
    ).read_text()[-3000:] + context
    assert ranks(1, train(data, run, ONE), tmp_path, "one") == [0], context
    logs = [(tmp_path / f"{prefix}-0.out").read_text() for prefix in ("three", "one")]
    (kept,) = map(int, re.findall(r"resumed from \S+step-(\d+): step", logs[0]))
    for log, saved_by in zip(logs, (2, 3)):
        assert f"positions saved by {saved_by} rank(s) dealt again" in log, log[-2000:] + context
    consumed = [
        line
        for path in sorted(tmp_path.glob("ids-killed-*"))
        for line in path.read_text().split()[: BATCH * kept]
    ] + [line for prefix in ("three", "one") for line in trained_ids_of(tmp_path, prefix)]
    assert len(consumed) == BATCH * (2 * kept + 3 * (THREE - kept) + (ONE - THREE)), context
    assert not [i for i, n in Counter(consumed).items() if n > 1], f"trained twice {context}"
    for name, plan in zip(("web", "code"), plans(data)):
        for index, shard in enumerate(plan.shards):
            reader = filestream.FileReader(plan, 0, 1)
            reader.queue = [entry for entry in reader.queue if entry[0] == index]
            ids = [bytes(s[:6].tolist()).decode() for s in reader]
            taken = sorted(i for i in consumed if i[:2] == ids[0][:2])
            assert taken == ids[: len(taken)], f"{shard.source.path}: {taken} {context}"
    last = records(run)[-1]
    assert last["samples_web"] + last["samples_code"] == len(consumed), (last, context)
    assert abs(last["samples_code"] / len(consumed) - 1 / 3) <= 0.1, (last, context)


def trained_ids_of(folder: Path, prefix: str) -> list[str]:
    return [
        line for path in sorted(folder.glob(f"ids-{prefix}-*")) for line in path.read_text().split()
    ]
