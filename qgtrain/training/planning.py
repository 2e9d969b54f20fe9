"""What must fit before the time limit: all the work until the next chance to stop, each kind
measured on its own (a step is a step; a validation, the test evaluation, a checkpoint and the
export are not).

Rank 0 asks at every agreement whether the work ahead still fits: the steps until the agreement
started now takes effect (it is read at the next agreement and reaches the host at the one after:
three agreements' worth of steps, agreement.py), each validation due in that window, the stop's
checkpoint, and, when the run ends in that window (its last step, or an early stop), the final
validation, the test evaluation, the final checkpoint and the export. If it does not fit, every rank
stops at a checkpoint now, and the next allocation does the rest: a run is finished only when its
final work is done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..data.loaders import Loaders
from ..runtime.deadline import Deadline
from .parts import Settings
from .timing import StepTimer

log = logging.getLogger("qgtrain")
# a fresh process that imports torch and transformers, before it reads anything
EXPORT_START_S = 20.0


@dataclass(frozen=True)
class Cadence:
    """The loop's shape, as far as the deadline needs it: how often it agrees and validates, and
    what its final work holds (not the learning-rate schedule: schedule.py)."""

    max_steps: int
    agree_every: int
    eval_every: int
    validation_batches: int  # per rank, per validation
    test_batches: int  # per rank
    early_stopping: bool
    export_on_finish: bool

    @classmethod
    def of(cls, loaders: Loaders, settings: Settings) -> Cadence:
        """The loop's cadence from its settings and the batches its loaders hold."""
        train = settings.train
        val = len(loaders.val) if loaders.val is not None else 0
        return cls(
            train.max_steps,
            train.agree_every,
            train.eval_every,
            min(val, train.eval_batches) if train.eval_batches else val,
            len(loaders.test) if loaders.test is not None else 0,
            settings.early_stopping.patience > 0,
            settings.export_on_finish,
        )


class Planner:
    def __init__(self, deadline: Deadline, timer: StepTimer, cadence: Cadence) -> None:
        self.deadline, self.timer, self.cadence = deadline, timer, cadence
        self._warned = False

    def out_of_time(self, step: int) -> bool:
        """Rank 0, as step `step` begins: whether the work until the next chance to stop no longer
        fits."""
        work, parts = self._work_from(step)
        due = self.deadline.due(work)
        if due:
            log.warning(
                "the time limit is %.0f s away (before the next chance to stop: %s; margin %.0f "
                "s): stopping at a checkpoint",
                self.deadline.left_s() or 0.0,
                ", ".join(parts),
                self.deadline.margin_s,
            )
        return due

    def final_work_fits(self) -> bool:
        """Rank 0, at the last step: whether the final validation, test, checkpoint and export
        fit."""
        work = self._final_work_s()
        fits = not self.deadline.due(work) or not self._possible(work)
        if not fits:
            log.warning(
                "the time limit is %.0f s away and the final validation, test evaluation, "
                "checkpoint and export take about %.0f s: stopping at a checkpoint to do them in "
                "the next allocation",
                self.deadline.left_s() or 0.0,
                work,
            )
        return fits

    def _work_from(self, step: int) -> tuple[float, list[str]]:
        s, timer = self.cadence, self.timer
        window = range(step, min(step + 3 * s.agree_every, s.max_steps + 1))
        validations = sum(
            1 for v in window if s.eval_every and v % s.eval_every == 0 and v < s.max_steps
        )
        ends = s.max_steps in window or (validations > 0 and s.early_stopping)
        step_s = timer.longest_step_s
        parts = [
            f"{len(window)} step(s) of up to {step_s:.2f} s",
            f"a checkpoint of {timer.longest_save_s:.1f} s",
        ]
        evaluations = validations * self._validation_s() + (self._final_work_s() if ends else 0.0)
        if validations:
            parts.append(f"{validations} validation(s) of {self._validation_s():.1f} s")
        if ends:
            parts.append(
                f"the final evaluation, checkpoint and export, {self._final_work_s():.1f} s"
            )
        if not self._possible(evaluations):
            evaluations, parts = 0.0, parts[:2]
        return len(window) * step_s + timer.longest_save_s + evaluations, parts

    def _final_work_s(self) -> float:
        save_s = self.timer.longest_save_s
        test_s = (
            self.timer.test_s
            if self.timer.test_s is not None
            else self._batch_s() * self.cadence.test_batches
        )
        export_s = EXPORT_START_S + 3 * save_s if self.cadence.export_on_finish else 0.0
        return self._validation_s() + test_s + save_s + export_s

    def _validation_s(self) -> float:
        """Its batches, and the downstream tasks beside it as they last took."""
        return self._batch_s() * self.cadence.validation_batches + self.timer.downstream_s

    def _batch_s(self) -> float:
        """An evaluation batch as measured; before any, half a training step (a forward without
        backward)."""
        return (
            self.timer.eval_batch_s
            if self.timer.eval_batch_s is not None
            else self.timer.longest_step_s / 2
        )

    def _possible(self, work_s: float) -> bool:
        """Evaluations longer than a whole allocation of this job would never fit: stopping for them
        would only requeue forever, so the run goes on and says why."""
        given = self.deadline.given_s()
        if given is None or work_s < 0.9 * given:
            return True
        if not self._warned:
            self._warned = True
            log.warning(
                "the evaluations before the next chance to stop (%.0f s) take longer than this "
                "job's whole time (%.0f s), so no allocation could hold them; training goes on. "
                "HINT: ask for more time (slurm.time), or evaluate fewer batches "
                "(train.eval_batches)",
                work_s,
                given,
            )
        return False
