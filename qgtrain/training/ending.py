"""How a run stops, step by step: the work after every step but the last (validate, report,
checkpoint, stop early or to resume when due), the last step's final work (validation, test and a
checkpoint, if they fit in the allocation), and a run that had already ended. Functions of the
trainer, as rollback.if_due is: the loop (trainer.py) reads top to bottom and calls them where a
step ends.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..runtime import distributed
from ..state.train_state import Outcome, TrainState
from .agreement import Flags
from .metrics import format_metrics, prefixed
from .parts import StepResult

if TYPE_CHECKING:
    from .trainer import Trainer

log = logging.getLogger("qgtrain")


def already_ended(state: TrainState, max_steps: int) -> Outcome | None:
    """A run that ended before (finished, early stopped) has nothing to do, unless train.max_steps
    was raised since it finished."""
    steps_left = state.step < max_steps
    if state.outcome is Outcome.FINISHED and steps_left:
        # train.max_steps was raised: carry on from the final checkpoint
        state.outcome = None
    if state.outcome:
        log.warning(
            "this run already ended at step %d (%s); nothing to do. HINT: raise "
            "train.max_steps to train on, or start afresh with checkpoint.resume: never or "
            "another train.run_name",
            state.step,
            state.outcome.value,
        )
        return state.outcome
    return None


def after_step(trainer: Trainer, done: StepResult, agreed: Flags) -> Outcome | None:
    """Every step but the last: validate, report, checkpoint and stop when due."""
    train, step = trainer.settings.train, done.step
    validated = bool(train.eval_every) and step % train.eval_every == 0
    early_stop = trainer.validator.validate(trainer.state) if validated else False
    if early_stop:
        trainer.validator.test(trainer.state)
        trainer.state.outcome = Outcome.EARLY_STOPPED
    if validated or step == trainer.first_step or step % train.log_every == 0:
        trainer.report_step(done, validated)
    every = trainer.settings.checkpoint.every_steps
    if agreed.stop or early_stop or agreed.checkpoint_due or (every and step % every == 0):
        trainer.save_step(validated, blocking=agreed.stop or early_stop)
    if agreed.stop:
        return stop_to_resume(trainer, step, agreed)
    if early_stop:
        trainer.agreement.finish()  # the group outlives no collective of ours
        log.info(
            "early stopping at step %d: %s has not improved for %d validations (best %.4f)",
            step,
            trainer.settings.early_stopping.metric,
            trainer.state.evals_since_best,
            trainer.state.best_metric,
        )
        return Outcome.EARLY_STOPPED
    return None


def at_the_end(trainer: Trainer, done: StepResult | None, agreed: Flags) -> Outcome:
    """The last step (`done`; None when an earlier allocation trained it): the final validation,
    test and checkpoint if they fit before the time limit, else a checkpoint now and that work
    in the next one."""
    fits = distributed.broadcast_from_main(
        trainer.planner.final_work_fits() if trainer.env.is_main else None
    )
    if agreed.stop or not fits:
        if done is not None:
            trainer.report_step(done, False)
            trainer.save_step(False, blocking=True)
        return stop_to_resume(trainer, trainer.state.step, agreed)
    trainer.validator.validate(trainer.state)
    trainer.validator.test(trainer.state)
    trainer.state.outcome = Outcome.FINISHED
    if done is not None:
        trainer.report_step(done, True)
    else:
        trainer.reporter.report_evaluation(trainer.state)
    trainer.save_step(True, blocking=True, again=done is None)
    trainer.agreement.finish()
    log.info(
        "finished at step %d: %s",
        trainer.state.step,
        format_metrics(
            {
                **prefixed("val", trainer.state.val_metrics),
                **prefixed("test", trainer.state.test_metrics),
            }
        ),
    )
    return Outcome.FINISHED


def stop_to_resume(trainer: Trainer, step: int, agreed: Flags) -> Outcome:
    trainer.agreement.finish()
    cause = ", ".join(trainer.parts.stop.received) or (
        "the time limit"
        if agreed.out_of_time or not agreed.stop
        else "a signal that reached another rank"
    )
    log.warning("stopping at step %d on %s: checkpoint saved", step, cause)
    return Outcome.STOPPED_TO_RESUME
