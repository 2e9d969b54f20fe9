"""train.spike_action: rollback. The poisoned sample of tests/factories.py spikes step 13 on rank 1
of two; with checkpoints every 5 steps both ranks go back to step 10 in the process and skip the
batches of steps 11 to 13. Equal bit for bit: a plain resume from step 10's checkpoint whose data
position is moved past those batches (rollback is a resume), a resume from step 10 as left by a job
killed before the next checkpoint (it meets the spike again and rolls back the same way), and a
resume from the checkpoint written after the rollback. Runs against: real 2-rank gloo runs of the
whole `qgtrain train` path, one rollback run shared by the tests, and the Spikes part in one
process."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from qgtrain.config.load import load_config
from qgtrain.foundation.errors import ConfigError
from qgtrain.state.checkpoint import MANIFEST, file_entry
from tests.factories import POISONED, SPIKE_STEP
from tests.helpers import assert_same_tensors, checkpoint_state, rank_log, records, tiny_config
from tests.ranks import run_ranks, train_rank

MAX_STEPS, EVERY, SAMPLES_PER_STEP = 18, 5, 8
ROLLBACK = [
    *POISONED,
    f"train.max_steps={MAX_STEPS}",
    f"checkpoint.every_steps={EVERY}",
    "train.spike_factor=3",
    "train.spike_action=rollback",
]


def train(run: Path, *sets: str) -> list[dict]:
    return run_ranks(2, train_rank, tiny_config(*ROLLBACK, *sets), str(run))


def saved(run: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in (run / "checkpoints").glob("step-*"))


def progress(run: Path, step: int = MAX_STEPS) -> dict:
    return json.loads((run / "checkpoints" / f"step-{step}" / "state.json").read_text())["trainer"]


def final(run: Path) -> dict[str, torch.Tensor]:
    return checkpoint_state(run / "checkpoints" / f"step-{MAX_STEPS}")


def history(run: Path) -> list[tuple]:
    return [(r["step"], r.get("loss"), r.get("skipped"), r.get("to_step")) for r in records(run)]


def copy_until(run: Path, to: Path, last: int) -> Path:
    """The run as a job killed after checkpoint `last` left it."""
    shutil.copytree(run, to)
    for step in saved(to):
        if step > last:
            shutil.rmtree(to / "checkpoints" / f"step-{step}")
    return to


def resume(run: Path) -> None:
    assert [r["exit"] for r in train(run)] == [0, 0]
    assert "resumed from" in rank_log(run, 0)


@pytest.fixture(scope="module")
def rolled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("rollback") / "rolled"
    assert [r["exit"] for r in train(run)] == [0, 0]
    return run


def test_a_spike_rolls_every_rank_back_to_the_checkpoint_and_skips_the_batches_since(
    rolled, tmp_path
):
    """Equal to a resume from step 10 with the data position moved past steps 11 to 13's batches:
    without the restore of the random streams (dropout), the optimizer or the data position, the
    weights differ; without the rollback (skip) the steps 11 and 12 stay trained and the run ends
    elsewhere."""
    got = records(rolled)
    rollback = [r for r in got if "skipped" in r]
    assert [
        (r["step"], r["skipped"], r["to_step"], r["batches"], r["spikes"]) for r in rollback
    ] == [(SPIKE_STEP, "rollback", 10, 3, 1)]
    assert rollback[0]["spike_loss"] > 3 * rollback[0]["spike_median"]
    assert [r["step"] for r in got if "loss" in r] == [
        *range(1, SPIKE_STEP),
        *range(11, MAX_STEPS + 1),
    ]
    for rank in (0, 1):
        assert f"step {SPIKE_STEP}: the loss" in rank_log(rolled, rank)
        assert "rolled back to the checkpoint of step 10 and skipped the 3 batch(es)" in rank_log(
            rolled, rank
        )
    assert saved(rolled) == [5, 10, 15, 18]
    state = progress(rolled)
    assert (
        state["samples_in_epoch"] == (MAX_STEPS + 3) * SAMPLES_PER_STEP
        and state["spikes_skipped"] == 1
    )
    assert progress(rolled, 15)["spikes_skipped"] == 1, (
        "the count survives the restore of step 10's state"
    )

    moved = copy_until(rolled, tmp_path / "moved", 10)
    ckpt = moved / "checkpoints" / "step-10"
    facts = json.loads((ckpt / "state.json").read_text())
    assert facts["trainer"]["samples_in_epoch"] == 10 * SAMPLES_PER_STEP
    facts["trainer"].update(samples_in_epoch=SPIKE_STEP * SAMPLES_PER_STEP, spikes_skipped=1)
    (ckpt / "state.json").write_text(json.dumps(facts, indent=1))
    manifest = json.loads((ckpt / MANIFEST).read_text())
    manifest["files"]["state.json"] = file_entry(ckpt / "state.json")
    (ckpt / MANIFEST).write_text(json.dumps(manifest))
    resume(moved)
    assert_same_tensors(final(rolled), final(moved))
    assert history(moved)[10:] == history(rolled)[-8:], "the same losses from step 11 on"
    assert progress(moved) == state


def test_a_job_killed_after_the_rollback_resumes_to_the_same_end(rolled, tmp_path):
    """Killed before the checkpoint after the rollback: the resume from step 10 meets the spike
    again and rolls back the same way (same records, count and weights). Killed after it: step 15's
    checkpoint holds the moved data position and the count, so the run ends the same; a position not
    moved would draw the poisoned batch again."""
    before = copy_until(rolled, tmp_path / "before", 10)
    resume(before)
    assert_same_tensors(final(rolled), final(before))
    assert history(before) == history(rolled) and progress(before) == progress(rolled)

    after = copy_until(rolled, tmp_path / "after", 15)
    resume(after)
    assert_same_tensors(final(rolled), final(after))
    assert history(after) == history(rolled) and progress(after) == progress(rolled)


def test_a_spike_before_the_first_checkpoint_stops_with_a_message_naming_checkpoint_every_steps(
    tmp_path,
):
    """Every rank stops at the spike (without the check, the rollback finds nothing and fails
    unexplained)."""
    for result in train(
        tmp_path / "run", f"train.max_steps={SPIKE_STEP}", "checkpoint.every_steps=100"
    ):
        assert result["exit"] == 1
        assert re.search(
            rf"the loss spiked at step {SPIKE_STEP} .* train.spike_action is rollback, but .* "
            r"holds no valid checkpoint of this run to roll back to\. The step was not applied\. "
            r"HINT: set checkpoint.every_steps",
            result["error"],
        )
    assert saved(tmp_path / "run") == []


def test_under_rollback_a_spike_is_counted_and_handed_over_not_skipped_in_place(tmp_path):
    """One process: the spike is counted against train.max_skips as under skip, but recorded by the
    rollback (rollback.py), not as a "spike" skip; past the limit it stops before any rollback."""
    from qgtrain.foundation.errors import TrainingError
    from qgtrain.training.metrics import MetricsLog
    from qgtrain.training.spikes import Spike, Spikes

    cfg = tiny_config("train.spike_factor=3", "train.spike_action=rollback", "train.max_skips=1")
    metrics = MetricsLog(tmp_path, True, False, None)
    spikes, ok = Spikes(cfg.train, metrics, torch.device("cpu")), torch.tensor(False)
    for step in range(1, 11):
        spikes.judge(torch.tensor(1.0), step, ok)
        assert not spikes.dropped(step) and spikes.rollback is None
    assert bool(spikes.judge(torch.tensor(10.0), 11, ok)) and spikes.dropped(11)
    assert spikes.take_rollback() == Spike(11, 10.0, 1.0, 1) and spikes.skips == 1
    assert spikes.take_rollback() is None, "a spike is rolled back once"
    spikes.judge(torch.tensor(10.0), 11, ok)
    with pytest.raises(TrainingError, match="spike 2 of the run, more than train.max_skips=1"):
        spikes.dropped(11)
    metrics.close()
    assert records(tmp_path) == []


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ["train.spike_action=undo"],
            "train.spike_action: 'undo' is not allowed; choose one of skip, rollback",
        ),
        (
            ["train.spike_action=rollback"],
            "train.spike_action: rollback acts on loss spikes, which "
            "train.spike_factor: 0 does not look for",
        ),
        (
            ["train.spike_action=rollback", "train.spike_factor=3", "checkpoint.every_steps=0"],
            "train.spike_action: rollback goes back to the latest checkpoint, and "
            "checkpoint.every_steps and checkpoint.every_minutes are both 0",
        ),
    ],
)
def test_bad_rollback_settings_name_the_key_and_what_is_allowed(sets, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config([], sets)


def test_the_batches_skipped_are_counted_across_epochs():
    """The record's "batches": rank 1 of 2 draws 5 full batches of 2 from 22 samples an epoch;
    counted from the data positions alone, at every draw over three epochs."""
    from types import SimpleNamespace

    from qgtrain.data.loaders import Loaders, ResumableSampler, TrainBatches, make_loader
    from qgtrain.runtime.rendezvous import DistEnv

    dataset = list(range(22))
    sampler = ResumableSampler(
        dataset, DistEnv(rank=1, world_size=2), seed=5, shuffle=True, drop_last=True
    )
    loader = make_loader(dataset, sampler, 2, 0, torch.device("cpu"), 5, True)
    batches, position = (
        TrainBatches(Loaders(sampler, loader, None, None), 4),
        SimpleNamespace(epoch=0, samples_in_epoch=8),
    )
    start = (0, 8)
    for drawn in range(1, 13):
        batches.next(position)
        assert batches.between(start, (position.epoch, position.samples_in_epoch)) == drawn
    assert position.epoch == 2
