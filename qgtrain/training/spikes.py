"""Loss spikes: a step whose loss jumps far above the recent ones is not applied; its batch is
dropped and the step is taken again with the next batch. And train.skip_steps, which drops the
batches of the steps it lists, so that a run which skipped spikes is reproduced, bit for bit, from
its start.

Deciding needs the loss of all ranks before the update: one all-reduce of a scalar per step (only
with train.spike_factor > 0), compared on the device with the median of the last applied steps'
losses, kept there. The update is then skipped on the device, as one from non-finite gradients is.
Every rank reaches the same decision from the same reduced loss (an all-reduce leaves the same bits
on every rank) and the same window, so the decision needs no agreement of its own. The host must
know it too, since a dropped batch does not advance the step counter: once the window holds enough
losses to decide, it reads one flag per step, after the update is queued (a host sync per step on a
GPU, so the host cannot run ahead of it by more than the update; free on a CPU).

A batch dropped by train.skip_steps still runs its forward and backward, as a spike's batch did, and
its update is skipped the same way: dropout draws the same random numbers, batch-norm statistics and
the optimizer see the same, so the two runs stay equal, at the cost of one forward and backward per
listed skip. (Putting back the random streams instead would cost a capture every step and still miss
what a forward changes in the model.)

Under train.spike_action: rollback a spike is counted the same way, and then handed to rollback.py,
which takes every rank back to the latest checkpoint."""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..runtime import diagnose
from .metrics import MetricsLog

log = logging.getLogger("qgtrain")
FIRST_DECISION = 10  # losses the window holds before it decides: min(train.spike_window, this)


class _Verdict(NamedTuple):
    planned: bool  # train.skip_steps drops this batch
    loss: torch.Tensor | None = None  # the step's loss over all ranks and micro-batches (float64)
    median: torch.Tensor | None = None  # of the window; None while it holds too few to decide
    spike: torch.Tensor | None = None


class Spike(NamedTuple):
    """A spike whose step is to be rolled back (train.spike_action: rollback)."""

    step: int
    loss: float
    median: float
    nth: int  # spikes of the run so far, this one included


class Spikes:
    """The window of recent losses, the spikes skipped so far, and the batches train.skip_steps
    drops."""

    def __init__(self, train: TrainConfig, metrics: MetricsLog, device: torch.device) -> None:
        self.factor, self.max_skips, self.metrics = train.spike_factor, train.max_skips, metrics
        # a step listed twice drops two batches
        self.planned = collections.Counter(train.skip_steps)
        self.window = torch.zeros(train.spike_window, dtype=torch.float64, device=device)
        self.known = 0  # losses in the window, at most its size
        self._next = 0  # where the next loss goes: the window is a ring
        self.skips = 0  # spikes skipped in the run, held against train.max_skips
        self._planned_done = 0  # batches train.skip_steps has dropped at the step being taken
        self._verdict: _Verdict | None = None
        self.rolls_back = train.spike_action == "rollback"
        self.rollback: Spike | None = None  # a spike rollback.py has yet to roll back

    def judge(self, loss_sum: torch.Tensor, step: int, bad_grads: torch.Tensor) -> torch.Tensor:
        """Whether to skip this step's update, as a device flag: train.skip_steps, a spike, or
        non-finite gradients (`bad_grads`). A collective on every rank when train.spike_factor > 0.
        """
        self._verdict = None
        if self._planned_done < self.planned[step]:
            self._verdict = _Verdict(planned=True)
            return torch.ones_like(bad_grads)
        if not self.factor:
            return bad_grads
        loss = _mean_over_ranks(loss_sum)
        if self.known < min(len(self.window), FIRST_DECISION):
            self._verdict = _Verdict(False, loss)
            return bad_grads
        median = self.window[: self.known].median()  # the lower middle value of an even count
        spike = loss > self.factor * median
        self._verdict = _Verdict(False, loss, median, spike)
        return bad_grads | spike

    def dropped(self, step: int) -> bool:
        """After the update is queued: whether the step's batch was dropped, so that the step is
        taken again with the next batch. Each drop is logged and recorded in metrics.jsonl; a spike
        past train.max_skips stops every rank (each reaches the same decision)."""
        verdict, self._verdict = self._verdict, None
        if verdict is not None and verdict.planned:
            self._planned_done += 1
            log.info(
                "step %d: a batch dropped as train.skip_steps asks; the step is taken again "
                "with the next batch",
                step,
            )
            self.metrics.write({"step": step, "skipped": "skip_steps", "time": time.time()})
            return True
        if verdict is not None and verdict.spike is not None and bool(verdict.spike):
            assert verdict.loss is not None and verdict.median is not None
            self._skip_spike(step, float(verdict.loss), float(verdict.median))
            return True
        if verdict is not None and verdict.loss is not None:
            self._remember(verdict.loss)
        self._planned_done = 0
        return False

    def _remember(self, loss: torch.Tensor) -> None:
        """An applied step's loss into the ring, over the oldest."""
        self.window[self._next] = loss
        self._next = (self._next + 1) % len(self.window)
        self.known = min(self.known + 1, len(self.window))

    def take_rollback(self) -> Spike | None:
        """The spike a rollback is due for (train.spike_action: rollback), once."""
        spike, self.rollback = self.rollback, None
        return spike

    def rolled_back(self, spike: Spike) -> None:
        """After the rollback to an earlier checkpoint, whose count of skips was restored: a
        rollback never takes back a count, so repeated ones reach train.max_skips."""
        self.skips = spike.nth

    def _skip_spike(self, step: int, loss: float, median: float) -> None:
        self.skips += 1
        if self.skips > self.max_skips:
            raise diagnose.too_many_spikes(step, loss, median, self.skips, self.max_skips)
        if self.rolls_back:
            self.rollback = Spike(step, loss, median, self.skips)
            return
        log.warning(
            "step %d: the loss %.6g is above train.spike_factor=%g x the median %.6g of "
            "the last %d steps' losses: the update was not applied, the batch is dropped "
            "and the step is taken again with the next batch (spike %d of at most "
            "train.max_skips=%d; train.skip_steps: [%d] drops the same batch in a run from "
            "the start)",
            step,
            loss,
            self.factor,
            median,
            self.known,
            self.skips,
            self.max_skips,
            step,
        )
        self.metrics.write(
            {
                "step": step,
                "skipped": "spike",
                "spike_loss": loss,
                "spike_median": median,
                "spikes": self.skips,
                "time": time.time(),
            }
        )

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint's "spikes": the window, oldest loss first, and the spikes so far."""
        values = self.window.tolist()
        window = (
            values[: self.known]
            if self.known < len(values)
            else values[self._next :] + values[: self._next]
        )
        return {"loss_window": window, "spikes_skipped": self.skips}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A window made shorter since keeps its newest losses; a checkpoint from before spikes
        were judged holds none."""
        saved = state_dict.get("loss_window") or []
        values = saved[-len(self.window) :]
        self.window.zero_()
        self.window[: len(values)] = torch.tensor(values, dtype=torch.float64)
        self.known, self._next = len(values), len(values) % len(self.window)
        self.skips = int(state_dict.get("spikes_skipped", 0))
        # the step taken next is state.step + 1, from its start
        self._planned_done, self._verdict = 0, None


def _mean_over_ranks(loss_sum: torch.Tensor) -> torch.Tensor:
    """The step's loss over all ranks (each rank's is its mean over its micro-batches), in
    float64."""
    total = loss_sum.detach().to(torch.float64, copy=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
        total /= dist.get_world_size()
    return total
