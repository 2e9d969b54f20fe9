"""The training loop: one code path for 1 and N ranks and for any task, every stop decision agreed
by all.

A step reads top to bottom in phases: agree (started now, read after the backward), the
micro-batches, forward and backward, act on what the ranks agreed, the update, then the after-step
work (validate, log, checkpoint, stop), each part saying when it is due (the validator, the
checkpointer). The last step ends with the final work (validation, test, checkpoint) if it fits in
the allocation. Early stopping is decided on rank 0 from the all-reduced validation metric and
broadcast. No rank ever raises, returns or skips a collective alone. The trainer receives its parts
(built by qgtrain/run.py), the objects a step calls (assembly.py) and the settings of the loop,
never the config, and builds nothing itself.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..data.batches import to_device
from ..runtime import diagnose, distributed
from ..runtime.rendezvous import DistEnv
from ..state import local_tier, train_state
from ..state.checkpoint import Checkpoint
from ..state.checkpointer import Why
from ..state.local_tier import LocalCheckpoint
from ..state.train_state import Outcome, TrainState
from . import rollback
from .agreement import Flags
from .assembly import Loop
from .metrics import format_metrics, prefixed
from .optimizers import check_resumed
from .parts import LoopParts, Settings, StepResult

log = logging.getLogger("qgtrain")


class Trainer:
    def __init__(
        self, parts: LoopParts, settings: Settings, env: DistEnv, device: torch.device, loop: Loop
    ) -> None:
        """`loop`: what the step calls, as assembly.assemble made it of `parts` and `settings`."""
        self.parts, self.settings, self.env, self.device = parts, settings, env, device
        self.parallel = parts.parallel
        self.state, self.lr, self.batches = loop.state, loop.lr, loop.batches
        self.timer, self.planner, self.ema = loop.timer, loop.planner, loop.ema
        self.validator, self.agreement, self.health = loop.validator, loop.agreement, loop.health
        self.spikes, self.reporter, self.saved = loop.spikes, loop.reporter, loop.saved
        # of this start: always logged, and where unused parameters are looked for
        self.first_step = 1

    def fit(self) -> Outcome:
        """Train, until the last checkpoint is written; a failure we can explain becomes a
        TrainingError naming its cause, step and fix."""
        try:
            outcome = self._loop()
            self.parts.checkpointer.wait()  # an asynchronous save may still be writing
            self.timer.close()
            return outcome
        except (RuntimeError, ConnectionError) as exc:  # OutOfMemoryError is a RuntimeError
            explained = diagnose.explain(
                exc,
                self.state.step + 1,
                self.env,
                self.parts.loaders.train.num_workers,
                self.settings.train.collective_timeout_s,
            )
            if explained is exc:
                raise
            raise explained from exc
        finally:
            self.parts.profiler.close()
            diagnose.disarm_watchdog()

    def _loop(self) -> Outcome:
        train = self.settings.train
        if (ended := _already_ended(self.state, train.max_steps)) is not None:
            return ended
        # A rank that makes no progress this long (a stuck loader, a deadlock) dumps its stacks and
        # exits.
        watchdog = diagnose.ProgressWatchdog(2 * train.collective_timeout_s + 300)
        self.first_step = self.state.step + 1
        self.timer.restart(self.state.step)
        # trained to the end, the final work left for this allocation
        if self.state.step == train.max_steps:
            return self._at_the_end(None, Flags())
        while self.state.step < train.max_steps:
            step = self.state.step + 1
            watchdog.progress()
            self.parts.profiler.step_begins(step)
            self.timer.start_step()
            agreeing = step == self.first_step or step % train.agree_every == 0
            if agreeing:
                self.agreement.start(self._what_this_rank_knows(step), self.health.bad_loss)
            lr = self.lr.set(self.state)
            reading = time.perf_counter()
            read = self.batches.step(self.state, train.grad_accum_steps)
            tokens = self.reporter.tokens_in(read)  # on the host: counting syncs no device
            micro_batches = [to_device(batch, self.device) for batch in read]
            self.timer.data_read(reading)
            loss_sum, grad_norm = self._forward_backward(micro_batches)
            agreed = self.agreement.read(self.health.bad_grads, step) if agreeing else Flags()
            if agreeing:
                self._act_on(agreed, step)
            if not self._apply_update(step, tokens, loss_sum):
                # the batch was dropped: what was agreed is acted on when the step is taken again
                self.agreement.hold(agreed)
                rollback.if_due(self)  # under train.spike_action: rollback
                continue
            self.parts.profiler.step_done(step)
            done = StepResult(step, lr, loss_sum, grad_norm)
            if step == train.max_steps:
                return self._at_the_end(done, agreed)
            if (outcome := self._after_step(done, agreed)) is not None:
                return outcome
        raise AssertionError("the loop ends at its last step")

    def _what_this_rank_knows(self, step: int) -> Flags:
        return Flags(
            stop_requested=self.parts.stop.requested,
            checkpoint_due=self.parts.checkpointer.due_by_clock(),
            local_due=self.parts.checkpointer.due_locally_by_clock(),
            save_failed=self.parts.checkpointer.failed,
            out_of_time=self.env.is_main and self.planner.out_of_time(step),
        )

    def _forward_backward(self, micro_batches: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        loss_sum = self.parallel.backward(self.parts.task.loss, micro_batches)
        grad_norm = self.parallel.clip(self.settings.optim.grad_clip)
        # with fp16, non-finite gradients are the loss scaler's to skip
        fp16 = self.parallel.scaler.is_enabled()
        self.health.record(loss_sum, grad_norm if not fp16 else None)
        return loss_sum, grad_norm

    def _act_on(self, agreed: Flags, step: int) -> None:
        """What must stop every rank before the update: a failed write, a bad value, unused
        parameters."""
        if agreed.save_failed:
            self.parts.checkpointer.wait()  # raises the failure, the same on every rank
        unused = (
            step == self.first_step
            and distributed.any_flags([bool(self._unused())], self.device)[0]
        )
        if agreed.bad_loss or agreed.bad_grads or unused:
            as_of = agreed.as_of if not unused else step
            self._fail(as_of, not unused, bool(self.health.bad_loss.item()))

    def _apply_update(self, step: int, tokens: int, loss_sum: torch.Tensor) -> bool:
        """The update, skipped on the device after non-finite gradients or for a dropped batch (a
        loss spike, train.skip_steps): then False, and the step is taken again with the next
        batch."""
        skip = self.spikes.judge(loss_sum, step, self.health.bad_grads)
        self.ema.update(self.parallel.update(skip))
        self.timer.training_done(step)
        if self.spikes.dropped(step):
            return False
        self.state.step = step
        self.parts.metrics.advance(step)
        self.reporter.taken(tokens)
        return True

    def _after_step(self, done: StepResult, agreed: Flags) -> Outcome | None:
        """Every step but the last: validate, report, checkpoint and stop, each when due."""
        step, state = done.step, self.state
        validated = self.validator.due(step)
        early_stop = self.validator.validate(state) if validated else False
        if early_stop:
            self.validator.test(state)
            state.outcome = Outcome.EARLY_STOPPED
        if validated or step == self.first_step or step % self.settings.train.log_every == 0:
            self._report(done, validated)
        checkpointer = self.parts.checkpointer
        why = (
            Why.STOP
            if agreed.stop or early_stop
            else checkpointer.due_now(step, agreed.checkpoint_due, agreed.local_due)
        )
        if why is not None:
            self._save(validated, why)
        if agreed.stop:
            return self._stop_to_resume(step, agreed)
        if early_stop:
            self.agreement.finish()  # the group outlives no collective of ours
            log.info(
                "early stopping at step %d: %s has not improved for %d validations (best %.4f)",
                step,
                self.settings.early_stopping.metric,
                state.evals_since_best,
                state.best_metric,
            )
            return Outcome.EARLY_STOPPED
        return None

    def _at_the_end(self, done: StepResult | None, agreed: Flags) -> Outcome:
        """The last step (`done`; None when an earlier allocation trained it): the final validation,
        test and checkpoint if they fit before the time limit, else a checkpoint now and that work
        in the next one."""
        state = self.state
        fits = distributed.broadcast_from_main(
            self.planner.final_work_fits() if self.env.is_main else None
        )
        if agreed.stop or not fits:
            if done is not None:
                self._report(done, False)
                self._save(False, Why.STOP)
            return self._stop_to_resume(state.step, agreed)
        self.validator.validate(state)
        self.validator.test(state)
        state.outcome = Outcome.FINISHED
        if done is not None:
            self._report(done, True)
        else:
            self.reporter.report_evaluation(state)
        self._save(True, Why.FINAL if done is not None else Why.FINAL_AGAIN)
        self.agreement.finish()
        metrics = {**prefixed("val", state.val_metrics), **prefixed("test", state.test_metrics)}
        log.info("finished at step %d: %s", state.step, format_metrics(metrics))
        return Outcome.FINISHED

    def _stop_to_resume(self, step: int, agreed: Flags) -> Outcome:
        self.agreement.finish()
        cause = ", ".join(self.parts.stop.received) or (
            "the time limit"
            if agreed.out_of_time or not agreed.stop
            else "a signal that reached another rank"
        )
        log.warning("stopping at step %d on %s: checkpoint saved", step, cause)
        return Outcome.STOPPED_TO_RESUME

    def _report(self, done: StepResult, evaluated: bool) -> None:
        self.reporter.report(
            self.state,
            done.lr,
            done.loss_sum,
            done.grad_norm,
            self.timer.interval(done.step),
            evaluated,
        )

    def _save(self, evaluated: bool, why: Why) -> None:
        """Checkpoint the step just taken, once what the ranks agreed is settled (a checkpoint must
        not hold a non-finite value not yet read) and the replicas agree."""
        state, es = self.state, self.settings.early_stopping
        settled = self.agreement.settle(self.health.bad_grads, state.step)
        if settled.bad_loss or settled.bad_grads:
            self._fail(settled.as_of, True, bool(self.health.bad_loss.item()))
        saving = time.perf_counter()
        self.parallel.agree_before_save(state.step)
        self.reporter.settle_tokens(state)
        facts = train_state.manifest_facts(state, evaluated, es.metric, es.mode)
        self.parts.checkpointer.save_parts(state.step, self.saved, facts, why)
        self.timer.saved(saving)

    def _unused(self) -> list[str]:
        """The parameters DDP would wait for forever (unless told to look for unused ones, at a
        cost)."""
        return self.parallel.unused_parameters(self.settings.train.find_unused_parameters)

    def _fail(self, step: int, bad_loss: bool, bad_here: bool) -> None:
        """Raise the same diagnosed error on every rank (the collective below is taken by all)."""
        ranks = distributed.flagged_ranks(
            bad_here if bad_loss else bool(self._unused()), self.device
        )
        if bad_loss:
            raise diagnose.non_finite_loss(step, self.settings.train.agree_every, ranks)
        raise diagnose.unused_parameters(step, ranks, self._unused())

    def restore(self, ckpt: Checkpoint | LocalCheckpoint) -> None:
        self.parts.checkpointer.restore(ckpt, self.saved)
        check_resumed(self.state, self.parallel.optimizer)
        log.info(
            "resumed from %s: step %d, epoch %d%s",
            ckpt.path,
            self.state.step,
            self.state.epoch,
            local_tier.described(ckpt) if isinstance(ckpt, LocalCheckpoint) else "",
        )

    def rewind(self, ckpt: Checkpoint) -> int:
        """Back to `ckpt` (a rollback), the data position left where it stands: the batches drawn
        since are skipped, not trained on again. Returns how many."""
        state, here = self.state, (self.state.epoch, self.state.samples_in_epoch)
        self.restore(ckpt)
        skipped = self.batches.between((state.epoch, state.samples_in_epoch), here)
        state.epoch, state.samples_in_epoch = here  # where the loader's iterator stands
        self.reporter.forget_pending()
        self.timer.restart(state.step)
        return skipped


def _already_ended(state: TrainState, max_steps: int) -> Outcome | None:
    """A run that ended before (finished, early stopped) has nothing to do, unless train.max_steps
    was raised since it finished."""
    if state.outcome is Outcome.FINISHED and state.step < max_steps:
        state.outcome = None  # train.max_steps was raised: carry on from the final checkpoint
    if state.outcome:
        log.warning(
            "this run already ended at step %d (%s); nothing to do. HINT: raise "
            "train.max_steps to train on, or start afresh with checkpoint.resume: never or "
            "another train.run_name",
            state.step,
            state.outcome.value,
        )
    return state.outcome
