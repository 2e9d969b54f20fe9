"""The deadline counts all the work before the next chance to stop, each kind measured on its own.
Runs against: the planner with a real Deadline and StepTimer (tables of measured durations), and
real `qgtrain train` processes whose evaluations take a known time (a sleep, the same on a busy
machine)."""

from __future__ import annotations

import json
import time

import pytest

from qgtrain.foundation.errors import EXIT_STOPPED
from qgtrain.runtime.deadline import Deadline
from qgtrain.training.planning import Cadence, Planner
from qgtrain.training.timing import StepTimer
from tests.helpers import records
from tests.ranks import start_cli_ranks, wait_ranks


def planner(
    left_s: float,
    step_s: float,
    eval_batch_s: float | None,
    save_s: float,
    *,
    given_s: float = 3600,
    validation_batches: int = 10,
    test_batches: int = 40,
    export: bool = False,
) -> Planner:
    now = time.time()
    deadline = Deadline(now + left_s, None, margin_s=5.0)
    deadline.started = now + left_s - given_s
    timer = StepTimer(0)
    timer.recent_steps_s.extend([step_s / 2, step_s])
    timer.eval_batch_s, timer.longest_save_s = eval_batch_s, save_s
    return Planner(
        deadline,
        timer,
        Cadence(
            max_steps=1000,
            agree_every=1,
            eval_every=100,
            validation_batches=validation_batches,
            test_batches=test_batches,
            early_stopping=False,
            export_on_finish=export,
        ),
    )


@pytest.mark.parametrize(
    "step, left_s, stop, why",
    [
        (
            150,
            20.0,
            False,
            "no validation due: two steps of 0.5 s and a 2 s checkpoint fit in 20 s",
        ),
        (99, 20.0, True, "a validation of 10 batches x 3 s is due at step 100"),
        (99, 60.0, False, "the validation is due, and 60 s hold it"),
        (101, 10.0, False, "after a validation the steps are still 0.5 s steps, not 30 s ones"),
        (999, 60.0, True, "the last step: final validation 30 s, test 120 s, checkpoint 2 s"),
        (999, 170.0, False, "the final work fits in 170 s"),
    ],
)
def test_the_work_before_the_next_chance_to_stop_is_counted_kind_by_kind(step, left_s, stop, why):
    assert planner(left_s, step_s=0.5, eval_batch_s=3.0, save_s=2.0).out_of_time(step) is stop, why


def test_an_evaluation_never_measured_counts_half_a_step_per_batch_and_the_export_its_own_time():
    plan = planner(100.0, step_s=2.0, eval_batch_s=None, save_s=10.0, export=True)
    # final work: validation 10 x 1 s + test 40 x 1 s + checkpoint 10 s + export 20 s + 3 x 10 s =
    # 110 s
    assert plan.out_of_time(999) and not planner(200.0, 2.0, None, 10.0, export=True).out_of_time(
        999
    )
    assert not planner(100.0, step_s=2.0, eval_batch_s=None, save_s=10.0).out_of_time(999), (
        "no export: 60 s"
    )


def test_the_downstream_tasks_count_with_the_validation_they_run_beside():
    plan = planner(40.0, step_s=0.5, eval_batch_s=1.0, save_s=2.0)
    # a validation due at step 100: 10 x 1 s, a checkpoint 2 s, two steps 1 s
    assert not plan.out_of_time(99)
    plan.timer.downstream_s = 30.0  # eval.tasks took 30 s last time
    assert plan.out_of_time(99), "43 s of work is due before the next chance to stop"
    assert not plan.out_of_time(150), "no validation, no downstream tasks"


def test_evaluations_longer_than_a_whole_allocation_are_no_reason_to_stop(caplog):
    """Stopping for them would requeue forever: the run goes on and says why; steps still count."""
    # final work: 152 s
    plan = planner(30.0, step_s=0.5, eval_batch_s=3.0, save_s=2.0, given_s=100.0)
    with caplog.at_level("WARNING", logger="qgtrain"):
        assert not plan.out_of_time(999) and plan.final_work_fits()
    assert caplog.text.count("no allocation could hold them") == 1
    assert planner(7.0, step_s=0.5, eval_batch_s=3.0, save_s=2.0, given_s=100.0).out_of_time(999), (
        "two steps and a checkpoint (3 s) and the margin (5 s) do not fit in 7 s"
    )


def test_a_final_evaluation_that_cannot_fit_is_done_by_the_next_start_and_equals_an_uninterrupted_run(  # noqa: E501 (the test's name, which says what it proves)
    tmp_path,
):
    """Training takes about 17 s of a 34 s train.max_time (counted from process start), the final
    validation and test about 16 s: the first start stops at its last step with a checkpoint, the
    second does only the final work. The reference trains uninterrupted alongside."""
    args = [
        "train",
        "--set",
        "task.factory=tests.tasks:slow_evaluation",
        "task.options.size=96",
        "task.options.test_size=120",
        "task.options.step_s=0.5",
        "task.options.eval_batch_s=0.5",
        "train.batch_size=4",
        "train.max_steps=30",
        "train.eval_every=10",
        "train.eval_batches=2",
        "train.log_every=1",
        "checkpoint.every_steps=0",
        "logging.tensorboard=false",
        "optim.warmup_steps=0",
        "train.stop_margin_s=1",
    ]
    # validations: 2 batches of 0.5 s; the test: 120 points in 30 batches of 0.5 s
    deferred, reference = tmp_path / "deferred", tmp_path / "reference"
    first = start_cli_ranks(
        1, [*args, "train.max_time=34s", "--run-dir", str(deferred)], tmp_path, log_prefix="a"
    )
    alongside = start_cli_ranks(1, [*args, "--run-dir", str(reference)], tmp_path, log_prefix="ref")
    assert wait_ranks(first, 180) == [EXIT_STOPPED]
    state = json.loads((deferred / "checkpoints" / "step-30" / "state.json").read_text())["trainer"]
    assert state["step"] == 30 and state["outcome"] is None and state["test_metrics"] == {}
    assert "stopping at step 30 on the time limit" in (deferred / "logs" / "rank_0.log").read_text()
    assert wait_ranks(
        start_cli_ranks(1, [*args, "--run-dir", str(deferred)], tmp_path, log_prefix="b"), 180
    ) == [0]
    assert wait_ranks(alongside, 180) == [0]
    want, have = records(reference), records(deferred)
    assert [r["loss"] for r in have if "loss" in r] == [r["loss"] for r in want]
    final_want = {k: v for k, v in want[-1].items() if k.startswith(("val_", "test_"))}
    assert final_want.keys() >= {"val_loss", "val_accuracy", "test_loss", "test_accuracy"}
    assert {k: v for k, v in have[-1].items() if k.startswith(("val_", "test_"))} == final_want
    assert have[-1]["step"] == 30 and "loss" not in have[-1], "the second start trained nothing"
    status = json.loads((deferred / "status.json").read_text())
    assert status["status"] == "finished"
    manifest = json.loads((deferred / "checkpoints" / "step-30" / "manifest.json").read_text())
    assert manifest["outcome"] == "finished", (
        "the final checkpoint replaced the one without its evaluation"
    )
