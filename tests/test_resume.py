"""Killed at any instant, resumed, identical: real `qgtrain train` processes SIGKILLed at random
steps and once inside a checkpoint write, then resumed, compared with an uninterrupted run bit for
bit (every step's loss, the validation losses, the final weights and optimizer state)."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import checkpoint_state, records, wait_for
from tests.ranks import kill_ranks, start_cli_ranks, wait_ranks

MAX_STEPS = 24


def settings(tmp_path: Path, workers: int) -> list[str]:
    return [
        "--set",
        f"train.max_steps={MAX_STEPS}",
        "train.log_every=1",
        "train.eval_every=8",
        "train.eval_batches=2",
        "checkpoint.every_steps=4",
        "model.dropout=0.1",
        "model.hidden=256",
        "model.layers=3",
        "data.corpus_mb=0.4",
        "data.seq_len=64",
        "train.batch_size=8",
        "logging.tensorboard=false",
        f"data.num_workers={workers}",
        f"data.cache_dir={tmp_path / 'data'}",
        "optim.warmup_steps=4",
    ]


def final_state(run_dir: Path) -> dict[str, torch.Tensor]:
    return checkpoint_state(run_dir / "checkpoints" / f"step-{MAX_STEPS}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int, int], Path]:
    """The uninterrupted run for a world size and worker count, trained once, saving synchronously:
    the asynchronous-save case compares with it too."""
    made: dict[tuple[int, int], Path] = {}

    def run_for(world: int, workers: int) -> Path:
        if (world, workers) not in made:
            tmp = tmp_path_factory.mktemp(f"uninterrupted-{world}-{workers}")
            args = ["train", *settings(tmp, workers), "--run-dir", str(tmp / "run")]
            assert (
                wait_ranks(start_cli_ranks(world, args, tmp, log_prefix="ref"), 300) == [0] * world
            )
            made[world, workers] = tmp / "run"
        return made[world, workers]

    return run_for


@pytest.mark.slow
@pytest.mark.parametrize("world, workers, async_save", [(2, 0, False), (1, 2, True)])
def test_sigkill_at_random_points_then_resume_equals_the_uninterrupted_run(
    tmp_path, uninterrupted, world, workers, async_save
):
    """Two ranks saving synchronously; one rank with loader workers saving in the background. With
    async_save only the killed run writes in the background: its checkpoints must hold exactly what
    the synchronous reference's do, and a kill inside a background write must leave the previous one
    valid."""
    seed = int(os.environ.get("QGTRAIN_TEST_SEED", time.time()))
    picker = random.Random(seed)
    args = ["train", *settings(tmp_path, workers)]
    reference = uninterrupted(world, workers)

    run = tmp_path / "killed"
    cmd = [
        *args,
        f"checkpoint.async_save={str(async_save).lower()}",
        "logging.tensorboard=true",
        "--run-dir",
        str(run),
    ]
    # The last kill comes after step 8, whose save waits for step 4's: by then a checkpoint is
    # committed whatever the earlier kills hit, so the last restart surely resumes.
    last_kill = picker.randrange(9, MAX_STEPS - 4)
    first_kill = picker.randrange(2, last_kill)
    plan = [("step", first_kill), ("checkpoint write", None), ("step", last_kill)]
    for kind, step in plan:
        procs = start_cli_ranks(world, cmd, tmp_path, log_prefix="killed")
        if kind == "step":
            wait_for(
                lambda: any(r["step"] >= step for r in records(run)[-1:]), procs, f"step {step}"
            )
        else:
            wait_for(
                lambda: any((run / "checkpoints").glob(".tmp-step-*")), procs, "a checkpoint write"
            )
        kill_ranks(procs)
        if kind == "checkpoint write":
            assert list((run / "checkpoints").glob(".tmp-step-*")), (
                "the kill must land inside the write"
            )
    assert (
        wait_ranks(start_cli_ranks(world, cmd, tmp_path, log_prefix="killed"), 300) == [0] * world
    )

    expected, got = records(reference), records(run)
    context = (
        f"(seed {seed}: kills at step {first_kill}, in a checkpoint write, at step {last_kill})"
    )
    assert [r["step"] for r in got] == list(range(1, MAX_STEPS + 1)), context
    for want, have in zip(expected, got):
        assert have["loss"] == want["loss"], f"step {want['step']} {context}"
        assert have.get("val_loss") == want.get("val_loss"), f"step {want['step']} {context}"
    # TensorBoard too: what a killed attempt wrote after its last checkpoint is purged, each step
    # once.
    board = EventAccumulator(str(run / "tb"))
    board.Reload()
    assert [(e.step, e.value) for e in board.Scalars("train/loss")] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in expected
    ], context
    reference_state, resumed_state = final_state(reference), final_state(run)
    assert reference_state.keys() == resumed_state.keys()
    for name, tensor in reference_state.items():
        assert torch.equal(tensor, resumed_state[name]), f"{name} {context}"
    # Kills before the first commit restart from scratch, so only the last restart surely resumes.
    assert "resumed from" in (run / "logs" / "rank_0.log").read_text(), context
