"""train.spike_action: rollback. A spike can show after the update that did the damage: the weights
are bad already, and skipping the spiking batch keeps them. So every rank goes back to the latest
valid checkpoint of the run, in the process, restored exactly as a resume restores it (weights,
optimizer, loss scaler, random streams, progress, the spike window), and the data position is then
moved past every batch drawn since that checkpoint, the spiking one included: those batches are not
trained on again.

Every rank reaches the spike from the same all-reduced loss (spikes.py), so all roll back together,
and finding the checkpoint is the start's own finding (rank 0 lists, every rank checks its share).
What a later resume needs is in the state the next checkpoint saves: the data position past the
skipped batches and the spikes counted. A job killed before that checkpoint resumes from the same
one, trains the same steps, meets the same spike and rolls back the same way, so the run ends as if
never stopped. metrics.jsonl keeps the records of the steps rolled back, before the rollback's.

With no checkpoint yet (a spike before the first), the run stops: rolling back to the run's start
would need the initial weights kept, and skipping instead would keep weights the user has said a
spike may have damaged. The message names checkpoint.every_steps.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Protocol

from ..foundation.errors import TrainingError
from ..state.checkpoint import Checkpoint
from ..state.train_state import TrainState
from .parts import LoopParts
from .spikes import Spike, Spikes

log = logging.getLogger("qgtrain")


class Rewinding(Protocol):
    """What a rollback asks of the trainer."""

    state: TrainState
    parts: LoopParts
    spikes: Spikes

    def rewind(self, ckpt: Checkpoint) -> int: ...


def if_due(trainer: Rewinding) -> None:
    """Roll every rank back if the step just dropped was a spike under train.spike_action: rollback
    (collectives: every rank calls this and all reach the same decision)."""
    spike = trainer.spikes.take_rollback()
    if spike is None:
        return
    checkpointer = trainer.parts.checkpointer
    ckpt = checkpointer.newest_intact(trainer.state.step)
    if ckpt is None:
        raise nothing_to_roll_back_to(spike, checkpointer.storage.root)
    batches = trainer.rewind(ckpt)
    trainer.spikes.rolled_back(spike)
    state = trainer.state
    log.warning(
        "step %d: the loss %.6g is above train.spike_factor=%g x the median %.6g: rolled "
        "back to the checkpoint of step %d and skipped the %d batch(es) drawn since, the "
        "spiking one included (spike %d of at most train.max_skips=%d)",
        spike.step,
        spike.loss,
        trainer.spikes.factor,
        spike.median,
        state.step,
        batches,
        spike.nth,
        trainer.spikes.max_skips,
    )
    trainer.parts.metrics.write(
        {
            "step": spike.step,
            "skipped": "rollback",
            "to_step": state.step,
            "batches": batches,
            "spike_loss": spike.loss,
            "spike_median": spike.median,
            "spikes": spike.nth,
            "time": time.time(),
        }
    )


def nothing_to_roll_back_to(spike: Spike, root: Path) -> TrainingError:
    return TrainingError(
        f"the loss spiked at step {spike.step} ({spike.loss:.6g} against a recent median of "
        f"{spike.median:.6g}) and train.spike_action is rollback, but {root} holds no valid "
        "checkpoint of this run to roll back to. The step was not applied. HINT: set "
        "checkpoint.every_steps below the step of the first spike judged (from step 11 with the "
        "default window), or use train.spike_action: skip"
    )
