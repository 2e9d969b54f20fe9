"""What the loop is made of, put together in one place: from the run's parts (built by
qgtrain/run.py) and the loop's settings, the objects a step calls, each with its own state. run.py
calls `assemble` and hands the result to the trainer, so the run has one composition root and the
trainer builds nothing; the tests' seam does the same with parts of its own."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.loaders import TrainBatches, train_batches
from ..data.mixture.mix import source_counts
from ..data.stream.dispatch import DispatchedBatches
from ..data.stream.streams import StreamBatches
from ..runtime.rendezvous import DistEnv
from ..state.stateful import Stateful
from ..state.train_state import TrainState
from .agreement import Agreement, Health
from .ema import Ema
from .flops import device_peak
from .horizon import LearningRate
from .optimizers import name_of
from .parts import LoopParts, Settings
from .planning import Cadence, Planner
from .report import Reporter
from .saved_parts import saved_parts
from .spikes import Spikes
from .timing import StepTimer
from .validation import Validator


@dataclass
class Loop:
    """The loop's own objects: its progress (`state`), the learning rate, the batches of a step,
    the step's clock and the deadline's planner, the EMA, validation, the ranks' agreement and
    the values it watches, the spike guard, the reporter, and what a checkpoint saves (`saved`,
    each part under its name, restored into these same objects)."""

    state: TrainState
    lr: LearningRate
    batches: TrainBatches | StreamBatches | DispatchedBatches
    timer: StepTimer
    planner: Planner
    ema: Ema
    validator: Validator
    agreement: Agreement
    health: Health
    spikes: Spikes
    reporter: Reporter
    saved: dict[str, Stateful]


def assemble(parts: LoopParts, settings: Settings, env: DistEnv, device: torch.device) -> Loop:
    train = settings.train
    parallel = parts.parallel
    state = TrainState(optimizer=name_of(parallel.optimizer))
    lr = LearningRate(settings.optim, train.max_steps, parallel.optimizer, state, env.is_main)
    batches = train_batches(
        parts.loaders, train.batch_size * env.world_size, train.collective_timeout_s
    )
    timer = StepTimer(0, parts.account)
    ema = Ema(parallel.model, train.ema_decay, parallel.strategy)
    validator = Validator(
        parallel,
        parts.task,
        parts.loaders,
        settings.early_stopping,
        train.eval_batches,
        settings.precision,
        env,
        device,
        timer,
        weights=ema.in_use if train.eval_ema else None,
        every=train.eval_every,
        downstream=parts.downstream,
    )
    spikes = Spikes(train, parts.metrics, device)
    reporter = Reporter(
        parts.task,
        parts.metrics,
        env,
        device,
        batches.samples * train.grad_accum_steps,
        train.max_steps,
        device_peak(device, settings.precision, train.peak_tflops),
        source_counts(parts.loaders.train, not parts.loaders.dispatch or env.rank == 0),
    )
    return Loop(
        state=state,
        lr=lr,
        batches=batches,
        timer=timer,
        planner=Planner(parts.deadline, timer, Cadence.of(parts.loaders, settings)),
        ema=ema,
        validator=validator,
        agreement=Agreement(device),
        health=Health(device),
        spikes=spikes,
        reporter=reporter,
        saved=saved_parts(parts, settings, env, state, batches, lr, ema, spikes),
    )
