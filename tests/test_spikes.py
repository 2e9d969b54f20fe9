"""Loss spikes skipped and reproduced: a poisoned sample on one rank of two (tests/factories.py)
spikes the loss at step 13; the step is not applied, its batch dropped and the step taken again, and
a run that drops the same batch by train.skip_steps from the start ends equal bit for bit, dropout
on. Runs against: real 2-rank gloo runs of the whole `qgtrain train` path sharing one spike run, a
resume from its checkpoint, and the Spikes part itself in one process."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from qgtrain.config.load import load_config
from qgtrain.foundation.errors import ConfigError
from tests.factories import MAX_STEPS, POISONED, SPIKE_STEP
from tests.helpers import (
    assert_same_tensors,
    checkpoint_state,
    fresh_cli,
    rank_log,
    records,
    tiny_config,
)
from tests.ranks import run_ranks, train_rank


def train(run: Path, *sets: str) -> list[dict]:
    return run_ranks(2, train_rank, tiny_config(*POISONED, *sets), str(run))


def final(run: Path) -> dict[str, torch.Tensor]:
    return checkpoint_state(run / "checkpoints" / f"step-{MAX_STEPS}")


def progress(run: Path, step: int = MAX_STEPS) -> dict:
    return json.loads((run / "checkpoints" / f"step-{step}" / "state.json").read_text())["trainer"]


@pytest.fixture(scope="module")
def spiked(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("spikes") / "spiked"
    assert [r["exit"] for r in train(run, "train.spike_factor=3")] == [0, 0]
    return run


def test_a_spike_on_one_rank_is_skipped_by_all_and_train_skip_steps_repeats_the_run_bit_for_bit(
    spiked, tmp_path
):
    """Without the skip the poisoned update is applied and the weights differ; without the
    all-reduced loss rank 0 (whose loss is normal) would apply it alone and the ranks would part."""
    got = records(spiked)
    skipped = [r for r in got if "skipped" in r]
    assert [(r["step"], r["skipped"], r["spikes"]) for r in skipped] == [(SPIKE_STEP, "spike", 1)]
    assert skipped[0]["spike_loss"] > 3 * skipped[0]["spike_median"]
    assert [r["step"] for r in got if "loss" in r] == list(range(1, MAX_STEPS + 1)), (
        "step 13 taken again"
    )
    for rank in (0, 1):
        assert f"step {SPIKE_STEP}: the loss" in rank_log(
            spiked, rank
        ) and "the batch is dropped" in rank_log(spiked, rank)
    state = progress(spiked)
    assert state["samples_in_epoch"] == (MAX_STEPS + 1) * 8, "the dropped batch is used up"
    assert state["spikes_skipped"] == 1 and len(state["loss_window"]) == MAX_STEPS

    again = tmp_path / "skip-steps"
    assert [r["exit"] for r in train(again, f"train.skip_steps=[{SPIKE_STEP}]")] == [0, 0]
    assert_same_tensors(final(spiked), final(again))
    assert [r["loss"] for r in records(again) if "loss" in r] == [
        r["loss"] for r in got if "loss" in r
    ]
    assert [(r["step"], r["skipped"]) for r in records(again) if "skipped" in r] == [
        (SPIKE_STEP, "skip_steps")
    ]


def test_a_resume_before_the_spike_keeps_the_window_and_skips_the_same_batch(spiked, tmp_path):
    """As if killed after step 8's checkpoint: the window restored holds 8 losses, so step 13 is
    judged (a window lost would hold only 4 by then, too few to judge, and the poison would be
    applied)."""
    resumed = tmp_path / "resumed"
    shutil.copytree(spiked, resumed)
    for step in (12, 16):
        shutil.rmtree(resumed / "checkpoints" / f"step-{step}")
    assert len(progress(resumed, 8)["loss_window"]) == 8
    assert [r["exit"] for r in train(resumed, "train.spike_factor=3")] == [0, 0]
    assert "resumed from" in rank_log(resumed, 0)
    assert_same_tensors(final(spiked), final(resumed))
    assert [(r["step"], r.get("loss"), r.get("skipped")) for r in records(resumed)] == [
        (r["step"], r.get("loss"), r.get("skipped")) for r in records(spiked)
    ]
    assert progress(resumed) == progress(spiked)


def test_a_spike_past_train_max_skips_stops_every_rank_with_one_message(tmp_path):
    results = train(tmp_path / "run", "train.spike_factor=3", "train.max_skips=0")
    for result in results:
        assert result["exit"] == 1
        assert f"the loss spiked at step {SPIKE_STEP}" in result["error"]
        assert "more than train.max_skips=0" in result["error"] and "HINT" in result["error"]
    saved = sorted(
        int(p.name.split("-")[1]) for p in (tmp_path / "run" / "checkpoints").glob("step-*")
    )
    assert saved == [4, 8, 12]


def test_the_window_judges_from_its_tenth_loss_counts_skips_and_round_trips(tmp_path):
    """One process: the window fills with applied losses only, judges by its median once it holds
    10, drops what train.skip_steps lists first, and a state stored and loaded judges the same."""
    from qgtrain.foundation.errors import TrainingError
    from qgtrain.training.metrics import MetricsLog
    from qgtrain.training.spikes import Spikes

    cfg = tiny_config(
        "train.spike_factor=3",
        "train.spike_window=12",
        "train.max_skips=1",
        "train.skip_steps=[2, 2]",
    )
    metrics = MetricsLog(tmp_path, True, False, None)
    spikes, ok = Spikes(cfg.train, metrics, torch.device("cpu")), torch.tensor(False)

    def take(spikes: Spikes, step: int, loss: float) -> bool:
        spikes.judge(torch.tensor(loss), step, ok)
        return spikes.dropped(step)

    assert take(spikes, 1, 100.0) is False, "too few losses to judge"
    assert [take(spikes, 2, 1.0) for _ in range(3)] == [True, True, False]
    assert [take(spikes, step, 1.0 + step) for step in range(3, 11)] == [False] * 8
    assert take(spikes, 11, 3 * 7.0 + 0.5) is True, (
        "above 3 x 7, the lower median of 100, 1, 4, ..., 11"
    )
    assert take(spikes, 11, 12.0) is False
    state = spikes.state_dict()  # the checkpoint's "spikes"
    assert state == {
        "loss_window": [100.0, 1.0, *[1.0 + s for s in range(3, 11)], 12.0],
        "spikes_skipped": 1,
    }
    for step in (12, 13):
        take(spikes, step, 13.0)
    state = spikes.state_dict()
    assert state["loss_window"] == [1.0, *[1.0 + s for s in range(3, 11)], 12.0, 13.0, 13.0], (
        "a ring of 12"
    )
    loaded = Spikes(cfg.train, metrics, torch.device("cpu"))
    loaded.load_state_dict(state)
    assert loaded.skips == 1 and torch.equal(
        loaded.window.sort().values, spikes.window.sort().values
    )
    with pytest.raises(
        TrainingError,
        match=r"spiked at step 14 .*spike 2 of the run, more than "
        r"train.max_skips=1",
    ):
        take(loaded, 14, 1000.0)
    metrics.close()
    assert [(r["step"], r["skipped"]) for r in records(tmp_path)] == [
        (2, "skip_steps"),
        (2, "skip_steps"),
        (11, "spike"),
    ]


def test_flags_read_for_a_dropped_batch_are_returned_again_by_the_next_read():
    """A stop read at a step whose batch was dropped must not be lost with it (the loop holds
    them)."""
    from qgtrain.training.agreement import Agreement, Flags

    agreement, ok = Agreement(torch.device("cpu")), torch.tensor(False)
    agreement.hold(Flags(stop_requested=True, checkpoint_due=True))
    held = agreement.read(ok, 7)
    assert held.stop and held.checkpoint_due and not held.out_of_time
    assert not agreement.read(ok, 7).stop, "once"


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ["train.spike_factor=0.5"],
            "train.spike_factor: 0.5 would call a loss at or below the recent median a "
            "spike; use 0 (off) or a factor above 1",
        ),
        (
            ["train.spike_window=1"],
            "train.spike_window: 1 is out of range; expected an integer >= 2",
        ),
        (["train.max_skips=-1"], "train.max_skips: -1 is out of range; expected an integer >= 0"),
        (
            ["train.max_steps=100", "train.skip_steps=[5, 101]"],
            "train.skip_steps: step 101 is not a step of this "
            "run; list steps from 1 to train.max_steps=100",
        ),
        (["train.skip_steps=[0]"], "train.skip_steps: step 0 is not a step of this run"),
        (
            ["train.skip_steps=[a]"],
            "train.skip_steps: expected a list of integers, e.g. [120, 455]",
        ),
        (
            ["train.spike_factor=3", "train.precision=fp16"],
            "train.spike_factor: fp16's loss scaler decides itself",
        ),
    ],
)
def test_bad_spike_settings_name_the_key_and_what_is_allowed(sets, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config([], sets)


def test_a_skip_step_beyond_the_run_is_refused_in_one_line_with_exit_2(tmp_path):
    result = fresh_cli("train", "--set", "train.skip_steps=[700]", cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "train.skip_steps: step 700 is not a step of this run" in result.stderr
    assert not (tmp_path / "runs").exists()
