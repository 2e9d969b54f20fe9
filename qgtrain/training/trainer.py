"""The training loop: one code path for 1 and N ranks and for any task, every stop decision agreed by all.

Decisions that change control flow (a stop signal, a non-finite loss, a due time-based checkpoint, unused
parameters) are all-reduced together at a step boundary; early stopping is decided on rank 0 from the
all-reduced validation metric and broadcast. No rank ever raises, returns or skips a collective alone.
The trainer receives its parts (built by qgtrain/run.py) and the settings of the loop, never the config.
"""

from __future__ import annotations

import collections
import enum
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import CheckpointConfig, EarlyStoppingConfig, OptimConfig, TrainConfig
from ..data.batches import to_device
from ..data.loaders import ResumableSampler
from ..errors import ConfigError
from ..runtime import diagnose, distributed
from ..runtime.deadline import Deadline
from ..runtime.rendezvous import DistEnv
from ..runtime.signals import StopFlag
from ..state import train_state
from ..state.checkpoint import Checkpoint
from ..state.checkpointer import Checkpointer
from ..state.sharded import is_sharded_model, sharded_state
from ..state.train_state import TrainState
from ..task import Task
from .evaluation import evaluate
from .gradients import accumulate_gradients
from .metrics import MetricsLog, format_metrics, memory_gb, prefixed, utilisation
from .optim import clip_gradients
from .schedule import lr_at

log = logging.getLogger("qgtrain")


class Outcome(enum.Enum):
    FINISHED = "finished"
    EARLY_STOPPED = "stopped early"
    STOPPED_BY_SIGNAL = "stopped by signal"


@dataclass
class Parts:
    """What the loop runs. `wrapped` is what forward and backward go through (DDP, torch.compile);
    `model` is the user's module inside it, used for evaluation, clipping and checkpoints."""

    task: Task  # with collate and loss filled in
    model: nn.Module
    wrapped: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    sampler: ResumableSampler
    train_loader: Any
    val_loader: Any
    test_loader: Any
    checkpointer: Checkpointer
    metrics: MetricsLog
    stop: StopFlag
    deadline: Deadline  # rank 0's; the others follow its agreed decision


@dataclass(frozen=True)
class Settings:
    train: TrainConfig
    optim: OptimConfig
    early_stopping: EarlyStoppingConfig
    checkpoint: CheckpointConfig
    precision: str  # resolved: fp32, bf16 or fp16


class Trainer:
    def __init__(self, parts: Parts, settings: Settings, env: DistEnv, device: torch.device) -> None:
        self.p, self.s, self.env, self.device = parts, settings, env, device
        self.state = TrainState()
        self.samples_per_micro = settings.train.batch_size * env.world_size
        self._pending_tokens = 0  # this rank's tokens since they were last summed over ranks
        self._step_s: collections.deque[float] = collections.deque(maxlen=20)  # recent steps, for the deadline
        self._save_s = 0.0  # the longest checkpoint so far

    def fit(self) -> Outcome:
        """Train; a failure we can explain becomes a TrainingError naming its cause, step and fix."""
        try:
            return self._loop()
        except (RuntimeError, ConnectionError) as exc:  # OutOfMemoryError is a RuntimeError
            explained = diagnose.explain(exc, self.state.step + 1, self.env, self.p.train_loader.num_workers,
                                         self.s.train.collective_timeout_s)
            if explained is exc:
                raise
            raise explained from exc
        finally:
            diagnose.disarm_watchdog()

    def _loop(self) -> Outcome:
        t, first = self.s.train, True
        # A rank that makes no progress this long (a stuck loader, a deadlock) dumps its stacks and exits.
        watchdog = diagnose.ProgressWatchdog(2 * t.collective_timeout_s + 300)
        if self.state.outcome == Outcome.FINISHED.value and self.state.step < t.max_steps:
            self.state.outcome = None  # train.max_steps was raised: carry on from the final checkpoint
        if self.state.outcome:
            log.warning("this run already ended at step %d (%s); nothing to do. HINT: raise train.max_steps to "
                        "train on, or start afresh with checkpoint.resume: never or another train.run_name",
                        self.state.step, self.state.outcome)
            return Outcome(self.state.outcome)
        batches = self._batches()
        # Non-finite gradients are the same on every rank once they are all-reduced, so each rank sees them
        # without agreeing (with fp16 they are the loss scaler's to skip); the loss says which rank began it.
        bad_grads_seen = torch.zeros((), dtype=torch.bool, device=self.device)
        bad_loss_here = torch.zeros((), dtype=torch.bool, device=self.device)
        # Each agreement runs during the steps until the next one, where it is read: the stop decisions
        # land one agreement later, but no step waits for a round trip between ranks.
        agreed = distributed.any_flags_later([False] * 5, self.device)
        last_save, busy_s, data_s, steps_at_log = time.monotonic(), 0.0, 0.0, self.state.step
        while self.state.step < t.max_steps:
            watchdog.progress()
            started, step = time.perf_counter(), self.state.step + 1
            stop = time_due = time_up = False
            if agree := first or step % t.agree_every == 0:
                due = self.env.is_main and bool(self.s.checkpoint.every_minutes) and \
                    time.monotonic() - last_save >= 60 * self.s.checkpoint.every_minutes
                previous, agreed = agreed, distributed.any_flags_later(
                    [self.p.stop.requested, due, self.p.checkpointer.failed, self.env.is_main and self._out_of_time(),
                     bad_loss_here], self.device)
            for group in self.p.optimizer.param_groups:
                group["lr"] = lr = lr_at(self.state.step, self.s.optim, t.max_steps)
            micro_batches = [to_device(next(batches), self.device) for _ in range(t.grad_accum_steps)]
            data_s += time.perf_counter() - started
            loss_sum = accumulate_gradients(self.p.wrapped, self.p.task.loss, micro_batches, self.s.precision,
                                            self.p.scaler, self.device)
            self.p.scaler.unscale_(self.p.optimizer)
            grad_norm = clip_gradients(self.p.model, self.s.optim.grad_clip)
            if not self.p.scaler.is_enabled():
                bad_grads_seen |= ~torch.isfinite(grad_norm)  # on the device: no sync until the agreement
            bad_loss_here |= ~torch.isfinite(loss_sum)
            if agree:  # one host sync: the previous agreement and this step's gradients
                stop, time_due, save_failed, time_up, bad_loss, bad_grads = (
                    bool(v) for v in torch.cat([previous(), bad_grads_seen.reshape(1).to(torch.int32)]).tolist())
                stop = stop or time_up
                if save_failed:
                    self.p.checkpointer.wait()  # raises the failure, the same on every rank
                unused = first and distributed.any_flags([self._has_unused()], self.device)[0]
                if bad_loss or bad_grads or unused:
                    self._fail(step, not unused, bool(bad_loss_here.item()))
            self.p.scaler.step(self.p.optimizer)
            self.p.scaler.update()
            self.p.optimizer.zero_grad(set_to_none=True)
            self.state.step = step
            self.p.metrics.advance(step)
            if self.p.task.tokens is not None:
                self._pending_tokens += sum(int(self.p.task.tokens(b)) for b in micro_batches)
            busy_s += time.perf_counter() - started  # training time only: validation is not throughput
            final = step == t.max_steps
            evaluated = final or (bool(t.eval_every) and step % t.eval_every == 0)
            early_stop = self._validate() if evaluated else False
            if final or early_stop:
                self.state.test_metrics = self._evaluate(self.p.test_loader, 0)
                self.state.outcome = (Outcome.FINISHED if final else Outcome.EARLY_STOPPED).value
            if evaluated or first or step % t.log_every == 0:  # the first step: an early sign of life
                self._log(step, lr, loss_sum, grad_norm, step - steps_at_log, busy_s, data_s, evaluated)
                busy_s, data_s, steps_at_log = 0.0, 0.0, step
            periodic = bool(self.s.checkpoint.every_steps) and step % self.s.checkpoint.every_steps == 0
            self._step_s.append(time.perf_counter() - started)
            if stop or final or early_stop or time_due or periodic:
                saving = time.perf_counter()
                self.save(evaluated, blocking=stop or final or early_stop)
                self._save_s, last_save = max(self._save_s, time.perf_counter() - saving), time.monotonic()
            if stop or early_stop or final:
                agreed()  # the group outlives no collective of ours
            if stop:
                cause = ", ".join(self.p.stop.received) or ("the time limit" if time_up else
                                                            "a signal that reached another rank")
                log.warning("stopping at step %d on %s: checkpoint saved", step, cause)
                return Outcome.STOPPED_BY_SIGNAL
            if early_stop:
                log.info("early stopping at step %d: %s has not improved for %d validations (best %.4f)", step,
                         self.s.early_stopping.metric, self.state.evals_since_best, self.state.best_metric)
                return Outcome.EARLY_STOPPED
            first = False
        log.info("finished at step %d: %s", self.state.step, format_metrics(
            {**prefixed("val", self.state.val_metrics), **prefixed("test", self.state.test_metrics)}))
        return Outcome.FINISHED

    def _batches(self) -> Iterator[Any]:
        """Micro-batches forever, across epochs, starting at the restored data position."""
        self.p.sampler.set_position(self.state.epoch, self.state.samples_in_epoch)
        while True:
            for batch in self.p.train_loader:
                self.state.samples_in_epoch += self.samples_per_micro
                yield batch
            self.state.epoch += 1
            self.state.samples_in_epoch = 0
            self.p.sampler.set_epoch(self.state.epoch)

    def _out_of_time(self) -> bool:
        """Rank 0: the steps until the agreement started now is read (two agreements away) and a checkpoint
        would no longer fit before the end."""
        step_s = max(self._step_s, default=0.0)
        due = self.p.deadline.due(step_s * 2 * self.s.train.agree_every + self._save_s)
        if due:
            log.warning("the time limit is %.0f s away (a step takes up to %.2f s, a checkpoint %.1f s, margin "
                        "%.0f s): stopping at a checkpoint", self.p.deadline.left_s() or 0.0, step_s, self._save_s,
                        self.p.deadline.margin_s)
        return due

    def _has_unused(self) -> bool:
        return isinstance(self.p.wrapped, DDP) and not self.s.train.find_unused_parameters and \
            bool(self._unused_names())

    def _unused_names(self) -> list[str]:
        return [n for n, p in self.p.model.named_parameters() if p.requires_grad and p.grad is None]

    def _fail(self, step: int, bad_loss: bool, bad_here: bool) -> None:
        """Raise the same diagnosed error on every rank (the collective below is taken by all)."""
        ranks = distributed.flagged_ranks(bad_here if bad_loss else self._has_unused(), self.device)
        if bad_loss:
            raise diagnose.non_finite_loss(step, self.s.train.agree_every, ranks)
        raise diagnose.unused_parameters(step, ranks, self._unused_names())

    def _evaluate(self, loader: Any, max_batches: int) -> dict[str, float | None]:
        if loader is None:
            return {}
        assert self.p.task.loss is not None  # filled in by build_task
        return evaluate(self.p.model, loader, self.p.task.loss, self.p.task.metrics, self.device,
                        self.s.precision, max_batches, lockstep=is_sharded_model(self.p.model))

    def _validate(self) -> bool:
        """Evaluate; rank 0 alone decides early stopping from the all-reduced metric and broadcasts it."""
        self.state.val_metrics = self._evaluate(self.p.val_loader, self.s.train.eval_batches)
        es, s = self.s.early_stopping, self.state
        name = es.metric.removeprefix("val_")
        if self.p.val_loader is not None and name not in s.val_metrics:
            raise ConfigError(f"early_stopping.metric: {es.metric} is not reported by the task (it reports "
                              f"{', '.join('val_' + n for n in s.val_metrics)}); name one of those")
        value = s.val_metrics.get(name)
        decision = None
        if self.env.is_main:
            sign = 1.0 if es.mode == "min" else -1.0
            improved = value is not None and (s.best_metric is None or
                                              sign * value < sign * s.best_metric - es.min_delta)
            best = value if improved else s.best_metric
            since = 0 if improved else s.evals_since_best + 1
            decision = (best, since, bool(es.patience) and since >= es.patience)
        s.best_metric, s.evals_since_best, stop = distributed.broadcast_from_main(decision)
        return bool(stop)

    def _log(self, step: int, lr: float, loss_sum: torch.Tensor, grad_norm: torch.Tensor, steps: int,
             busy_s: float, data_s: float, evaluated: bool) -> None:
        loss, norm, tokens = distributed.sum_tensor([loss_sum.item(), grad_norm.item(), self._pending_tokens],
                                                    self.device)
        self.state.tokens_seen, self._pending_tokens = self.state.tokens_seen + int(tokens), 0
        world = self.env.world_size
        record: dict[str, Any] = {
            "step": step, "epoch": self.state.epoch, "loss": loss / world, "lr": lr, "grad_norm": norm / world,
            "samples_per_s": steps * self.s.train.grad_accum_steps * self.samples_per_micro / busy_s}
        if self.p.task.tokens is not None:
            record.update(tokens_per_s=tokens / busy_s, tokens_seen=self.state.tokens_seen)
        record.update(data_wait_frac=data_s / busy_s, time=time.time(), **memory_gb(self.device),
                      **utilisation(self.p.task.flops_per_sample, record["samples_per_s"], self.device, world))
        self.p.metrics.warn_memory(self.env.rank, step, record)
        if evaluated:
            record.update(prefixed("val", self.state.val_metrics))
        if self.state.outcome:
            record.update(prefixed("test", self.state.test_metrics))
        self.p.metrics.write(record)
        speed = f"{record['tokens_per_s']:.0f} tok/s" if tokens else f"{record['samples_per_s']:.1f} samples/s"
        log.info("step %d/%d epoch %d loss %.4f%s lr %.2e %s", step, self.s.train.max_steps, self.state.epoch,
                 record["loss"], f" {format_metrics(prefixed('val', self.state.val_metrics))}" if evaluated else "",
                 lr, speed)

    def save(self, evaluated: bool, blocking: bool = False) -> None:
        s, es = self.state, self.s.early_stopping
        if self.env.world_size > 1 and not is_sharded_model(self.p.model):  # drifted replicas: saved as rank 0's
            differ = distributed.diverged([*self.p.model.named_parameters(), *self.p.model.named_buffers()],
                                          self.device)
            if differ:
                raise diagnose.diverged_replicas(s.step, differ)
        if self.p.task.tokens is not None:  # every rank is here: sum what is pending
            pending = int(distributed.sum_tensor([self._pending_tokens], self.device)[0])
            self.state.tokens_seen, self._pending_tokens = self.state.tokens_seen + pending, 0
        self.p.checkpointer.save(
            s.step, lambda: train_state.replicated_files(self.p.model, self.p.optimizer, self.p.scaler, s,
                                                         self.s.precision, self.env.world_size),
            train_state.rank_state(s), train_state.manifest_facts(s, evaluated, es.metric, es.mode), blocking=blocking,
            shards=sharded_state(self.p.model, self.p.optimizer) if is_sharded_model(self.p.model) else None)

    def restore(self, ckpt: Checkpoint) -> None:
        self.state = train_state.restore(ckpt, self.p.model, self.p.optimizer, self.p.scaler, self.env,
                                         self.s.train.seed)
        self.p.checkpointer.last_step = ckpt.step
