"""The training loop's phases, one by one, at the unit seam (tests/seam.py): a Trainer built in this
process from a linear model, qgtrain's real loaders, checkpointer and stop flag, on a one-rank
group. Runs against: the real Trainer and its parts; no ranks are started."""

from __future__ import annotations

import json

import pytest
import torch

from qgtrain.foundation.errors import TrainingError
from qgtrain.runtime.signals import StopFlag
from qgtrain.state.train_state import Outcome
from tests.helpers import records
from tests.seam import build_trainer, config, linear_task, one_rank_group


def trained_weights(tmp_path, *sets: str) -> torch.Tensor:
    with one_rank_group():
        trainer = build_trainer(tmp_path, linear_task(), config("train.max_steps=3", *sets))
        assert trainer.fit() == Outcome.FINISHED
        return trainer.parallel.model.weight.detach().clone()


def test_two_micro_batches_of_two_step_as_one_batch_of_four(tmp_path):
    """Accumulation averages the micro-batches' mean losses: with equal sizes, the batch's mean."""
    whole = trained_weights(tmp_path / "whole", "train.batch_size=4")
    split = trained_weights(tmp_path / "split", "train.batch_size=2", "train.grad_accum_steps=2")
    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-7)
    assert not torch.equal(whole, linear_task().model.weight), "the steps moved the weights"


def test_a_stop_requested_before_step_one_is_agreed_two_steps_on_and_saved_there(tmp_path):
    """The agreement is pipelined (agreement.py): what a rank knows at step 1 travels while steps 1
    and 2 compute, and every rank acts on it at step 3, together."""
    stop = StopFlag([])
    stop.received.append("SIGUSR2")
    with one_rank_group():
        trainer = build_trainer(tmp_path, linear_task(), config("train.max_steps=10"), stop)
        assert trainer.fit() == Outcome.STOPPED_TO_RESUME
    assert trainer.state.step == 3
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-3"]
    saved = json.loads((tmp_path / "checkpoints" / "step-3" / "state.json").read_text())
    assert saved["trainer"]["step"] == 3 and saved["trainer"]["outcome"] is None


def test_a_non_finite_loss_stops_training_naming_the_step_and_saves_nothing_after_it(tmp_path):
    calls = []

    def turns_nan(model, batch):  # type: ignore[no-untyped-def]
        calls.append(1)
        x, y = batch
        loss = ((model(x) - y) ** 2).mean()
        return loss * float("nan") if len(calls) == 3 else loss

    with one_rank_group():
        trainer = build_trainer(
            tmp_path,
            linear_task(loss=turns_nan),
            config("train.max_steps=10", "checkpoint.every_steps=1"),
        )
        with pytest.raises(TrainingError, match="step 3"):
            trainer.fit()
        trainer.parts.checkpointer.wait()
    saved = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert "step-3" not in saved and "step-2" in saved, "a checkpoint never holds a non-finite step"
    logged = records(tmp_path)
    assert [r["step"] for r in logged] == [1, 2, 3] and logged[-1]["loss"] != logged[-1]["loss"]


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 8)

    def forward(self, input_ids, attention_mask):  # type: ignore[no-untyped-def]
        return (self.embed(input_ids).mean(-1) * attention_mask).mean()


def test_padded_rows_count_their_real_tokens_not_the_padding(tmp_path):
    """data.format chat with data.packing false pads each row (attention_mask 0 there): tokens_seen
    and tokens/s count the real tokens, from the host batch before it moves."""
    from qgtrain.foundation.task import ReadyTask
    from qgtrain.tasks.causal_lm import batch_tokens

    real = [3, 8, 5, 1]  # one epoch: 2 steps of 2 rows of 8 tokens
    rows = [
        {"input_ids": torch.arange(8) % 8, "attention_mask": (torch.arange(8) < n).long()}
        for n in real
    ]
    task = ReadyTask(
        model=Tiny(),
        train=rows,
        collate=torch.utils.data.default_collate,
        loss=lambda model, batch: model(**batch),
        tokens=batch_tokens,
    )
    with one_rank_group():
        trainer = build_trainer(tmp_path, task, config("train.max_steps=2", "train.batch_size=2"))
        assert trainer.fit() == Outcome.FINISHED
    logged = records(tmp_path)
    assert trainer.state.tokens_seen == logged[-1]["tokens_seen"] == sum(real) == 17
    assert sum(r["tokens_per_s"] for r in logged) > 0
    assert batch_tokens({"input_ids": torch.zeros(2, 8)}) == 16, "no mask: every token is real"


def test_the_validator_and_the_checkpointer_say_when_they_are_due(tmp_path):
    """Each part owns its cadence: train.eval_every is the validator's, checkpoint.every_steps and
    checkpoint.every_minutes (rank 0's clock since the last save) the checkpointer's."""
    sets = ("train.max_steps=12", "train.eval_every=3", "checkpoint.every_steps=4")
    with one_rank_group():
        trainer = build_trainer(
            tmp_path, linear_task(), config(*sets, "checkpoint.every_minutes=1")
        )
        saver = trainer.parts.checkpointer
        assert [step for step in range(1, 13) if trainer.validator.due(step)] == [3, 6, 9, 12]
        assert [step for step in range(1, 13) if saver.due(step)] == [4, 8, 12]
        assert not saver.due_by_clock(), "no minute has passed since the start"
        saver._clock.saved_at -= 61  # the clock as it reads a minute after the last save
        assert saver.due_by_clock()
        assert not saver.due_by_clock(), "asked once: the agreement carries it to the save"
        saver.save(1, dict, {}, {}, blocking=True)
        assert not saver.due_by_clock(), "a save starts the minute again"
