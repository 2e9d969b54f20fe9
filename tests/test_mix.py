"""data.mix on 2 gloo ranks with 2 loader workers each (4 reading slots): the shares of the sources
within 0.05 of their weights and reported as samples_<name>, a small source starting its next
pass, a run SIGKILLed at a random step resumed bit for bit (losses, counts, weights), and the
mixtures qgtrain refuses in one line."""

from __future__ import annotations

import json
import os
import random
import re
import time
from pathlib import Path

import pytest

from qgtrain.configload import load_config
from qgtrain.errors import ConfigError
from tests.helpers import cli, records, wait_for
from tests.ranks import kill_ranks, start_cli_ranks, wait_ranks
from tests.test_streams import same_run

MAX_STEPS = 16
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


def write_source(path: Path, count: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as out:
        for index in range(count):
            words = " ".join(rng.choices(WORDS, k=rng.randint(20, 40)))
            out.write(json.dumps({"text": f"{path.stem} {index}: {words}"}) + "\n")


def mix(folder: Path, code: str | None = None) -> str:
    code = code or str(folder / "code.jsonl")
    return (f"data.mix=[{{name: web, files: ['{folder}/web.jsonl'], weight: 6}}, "
            f"{{name: code, files: ['{code}'], weight: 3}}]")


def train(folder: Path, run: Path, *sets: str) -> list[str]:
    return ["train", "--run-dir", str(run), "--set", "data.name=files", mix(folder),
            f"data.cache_dir={folder / 'cache'}", f"train.max_steps={MAX_STEPS}",
            "train.batch_size=4", "data.num_workers=2", "data.seq_len=32", "model.hidden=32",
            "model.layers=2", "train.log_every=1", "train.eval_every=8", "train.eval_batches=2",
            "checkpoint.every_steps=3", "logging.tensorboard=false", "optim.warmup_steps=2",
            *sets]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """web: about 60 windows per slot, never exhausted; code: 4 or 5 per slot, read about 3 times."""
    folder = tmp_path_factory.mktemp("mix")
    write_source(folder / "web.jsonl", 120, 1)
    write_source(folder / "code.jsonl", 9, 2)
    return folder


@pytest.fixture(scope="module")
def uninterrupted(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    codes = wait_ranks(start_cli_ranks(2, train(data, tmp / "run"), tmp, log_prefix="ref"), 240)
    assert codes == [0, 0], (tmp / "ref-0.out").read_text()[-3000:]
    return tmp / "run"


def test_two_ranks_two_workers_draw_each_source_by_its_weight_and_restart_the_small_one(
        uninterrupted):
    got = records(uninterrupted)
    assert [r["step"] for r in got] == list(range(1, MAX_STEPS + 1))
    for record in got:  # every sample of every rank counted once, as of that step
        assert record["samples_web"] + record["samples_code"] == record["step"] * 2 * 4, record
    last = got[-1]
    share = last["samples_code"] / (MAX_STEPS * 8)
    assert abs(share - 3 / 9) <= 0.05, last
    assert "val_loss" in last and "test_loss" in last and last["epoch"] == 0
    logs = [(uninterrupted / "logs" / f"rank_{rank}.log").read_text() for rank in (0, 1)]
    passes = [re.findall(r"data.mix: source '(\w+)' ran out in reading slot (\d) of 4 after "
                         r"(\d+) of its samples: starting its pass (\d)", log) for log in logs]
    slots = {(slot, int(nth)) for found in passes for name, slot, _, nth in found}
    assert {name for found in passes for name, *_ in found} == {"code"}, passes
    assert {(slot, 2) for slot in "0123"} <= slots, f"every slot read code again: {passes}"


def test_a_mixture_killed_at_a_random_step_resumes_bit_for_bit(data, uninterrupted, tmp_path):
    seed = int(os.environ.get("QGTRAIN_TEST_SEED", time.time()))
    kill_at = random.Random(seed).randrange(4, MAX_STEPS - 2)
    run, args = tmp_path / "killed", train(data, tmp_path / "killed")
    procs = start_cli_ranks(2, args, tmp_path, log_prefix="killed")
    wait_for(lambda: any(r["step"] >= kill_at for r in records(run)[-1:]), procs, f"step {kill_at}")
    kill_ranks(procs)
    codes = wait_ranks(start_cli_ranks(2, args, tmp_path, log_prefix="resumed"), 240)
    assert codes == [0, 0], (tmp_path / "resumed-0.out").read_text()[-3000:]
    context = f"(seed {seed}: killed at step {kill_at})"
    same_run(uninterrupted, run, context)
    counts = [[(r["samples_web"], r["samples_code"]) for r in records(path)]
              for path in (uninterrupted, run)]
    assert counts[0] == counts[1], context
    assert "resumed from" in (run / "logs" / "rank_0.log").read_text(), context


@pytest.mark.parametrize("sources, expected", [
    ("[{name: a, files: [x], weight: 0}]",
     r"data.mix\[0\].weight: source 'a' has weight 0; weights are positive numbers"),
    ("[{name: a, files: [x], weight: 1}, {name: b, files: [y], weight: -2}]",
     r"data.mix\[1\].weight: source 'b' has weight -2; weights are positive"),
    ("[{name: a, files: [x], weight: 1}, {name: a, files: [y], weight: 1}]",
     r"data.mix\[1\].name: source 'a' is named twice"),
    ("[{name: a, files: [], weight: 1}]",
     r"data.mix\[0\].files: source 'a': expected a non-empty list"),
    ("[{name: a, file: [x], weight: 1}]",
     r"data.mix\[0\]: each source is \{name, files, weight\}, got \['file', 'name', 'weight'\]"),
])
def test_a_bad_mixture_is_one_line_naming_the_source(sources, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config([], ["data.name=files", f"data.mix={sources}"])


def test_a_mixture_of_what_is_not_files_or_a_source_matching_nothing_exits_2_in_one_line(
        data, tmp_path):
    synthetic = cli("train", "--run-dir", str(tmp_path / "a"), "--set", "data.name=synthetic",
                    mix(data), cwd=tmp_path)
    missing = cli(*train(data, tmp_path / "b", "data.num_workers=0"), "--set",
                  mix(data, code=str(tmp_path / "nothing*.jsonl")), cwd=tmp_path)
    lines = []
    for out in (synthetic, missing):
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
        lines.append(out.stderr.strip().splitlines()[-1])
    assert re.fullmatch(r"qgtrain: error: .*data.mix: mixes data files; set data.name: files "
                        r"\(data.name is synthetic\)", lines[0]), lines[0]
    assert re.fullmatch(r"qgtrain: error: data.mix\[1\].files \(source 'code'\): "
                        r"'.*nothing\*.jsonl' matches no file or folder", lines[1]), lines[1]
