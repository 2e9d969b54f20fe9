"""train.profile_steps: a torch.profiler trace of the named steps on every rank, the top operators
in rank 0's log, and training bit for bit as without it. Runs against: real 2-rank gloo runs of the
whole `qgtrain train` path (dropout on, so the RNG's path counts too) and the traces torch.profiler
itself writes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from qgtrain.config.load import load_config
from qgtrain.foundation.errors import ConfigError
from tests.helpers import checkpoint_state, rank_log, records, tiny_config
from tests.ranks import run_ranks, train_rank

STEPS = 6
SETTINGS = [
    f"train.max_steps={STEPS}",
    "checkpoint.every_steps=0",
    "train.eval_every=0",
    "model.dropout=0.1",
]


def train(run: Path, *sets: str) -> None:
    assert [
        r["exit"] for r in run_ranks(2, train_rank, tiny_config(*SETTINGS, *sets), str(run))
    ] == [0, 0]


@pytest.mark.slow
def test_a_profiled_run_traces_every_rank_and_trains_bit_for_bit_as_an_unprofiled_one(tmp_path):
    plain, profiled = tmp_path / "plain", tmp_path / "profiled"
    train(plain)
    train(profiled, "train.profile_steps=[3, 4]")

    assert [r["loss"] for r in records(profiled)] == [r["loss"] for r in records(plain)]
    want = checkpoint_state(plain / "checkpoints" / f"step-{STEPS}")
    have = checkpoint_state(profiled / "checkpoints" / f"step-{STEPS}")
    assert want.keys() == have.keys() and all(want[k].equal(have[k]) for k in want)
    for rank in (0, 1):
        events = json.loads((profiled / "profiles" / f"rank_{rank}-steps_3-4.json").read_text())
        names = [e.get("name", "") for e in events["traceEvents"]]
        # the warm-up step (2) is discarded: the two active steps, with the model's own operators
        assert sorted(n for n in names if n.startswith("ProfilerStep#")) == [
            "ProfilerStep#1",
            "ProfilerStep#2",
        ]
        assert any(n.startswith("aten::") for n in names)
    log = rank_log(profiled, 0)
    assert (
        f"profile of steps 3-4 written to {profiled / 'profiles' / 'rank_0-steps_3-4.json'}" in log
    )
    assert re.search(r"Self CPU.*\n(.*\n)*.*aten::", log), "the top operators follow in the log"
    assert not (plain / "profiles").exists()


@pytest.mark.parametrize(
    "sets, message",
    [
        (["train.profile_steps=[3]"], "train.profile_steps: [3] is not [first, last]"),
        (["train.profile_steps=[5, 4]"], "train.profile_steps: [5, 4] is not [first, last]"),
        ([f"train.profile_steps=[5, {STEPS + 1}]"], f"<= train.max_steps={STEPS}"),
        (
            ["train.memory_snapshot=true"],
            "train.memory_snapshot: it records over train.profile_steps",
        ),
    ],
)
def test_profile_steps_outside_the_run_are_refused_with_the_key(sets, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config([], [f"train.max_steps={STEPS}", *sets])
