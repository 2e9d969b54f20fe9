"""The training loop: one code path for 1 and N ranks, every stop decision agreed by all ranks.

Decisions that change control flow (a stop signal, a non-finite loss, a due time-based checkpoint, unused
parameters) are all-reduced together at a step boundary; early stopping is decided on rank 0 from the
all-reduced validation loss and broadcast. No rank ever raises, returns or skips a collective alone.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import RunConfig
from ..data.loaders import EvalShard, ResumableSampler, Splits, make_loader
from ..errors import TrainingError
from ..runtime import diagnose, distributed, precision
from ..runtime.rendezvous import DistEnv
from ..runtime.signals import StopFlag
from ..state import train_state
from ..state.checkpoint import Checkpoint
from ..state.checkpointer import Checkpointer
from ..state.train_state import TrainState
from ..tasks.models import lm_loss
from .metrics import MetricsLog, memory_gb
from .optim import adamw, clip_gradients
from .schedule import lr_at

log = logging.getLogger("qgtrain")


class Outcome(enum.Enum):
    FINISHED = "finished"
    EARLY_STOPPED = "stopped early"
    STOPPED_BY_SIGNAL = "stopped by signal"


class Trainer:
    def __init__(self, cfg: RunConfig, env: DistEnv, device: torch.device, model: nn.Module, splits: Splits,
                 checkpointer: Checkpointer, metrics: MetricsLog, stop: StopFlag) -> None:
        self.cfg, self.env, self.device = cfg, env, device
        self.state = TrainState()
        self.checkpointer, self.metrics, self.stop = checkpointer, metrics, stop
        self.precision = precision.resolve(cfg.train.precision, device)
        self.raw_model = model.to(device)
        compiled = torch.compile(self.raw_model) if cfg.model.compile else self.raw_model
        self.ddp = env.world_size > 1
        self.model = DDP(compiled, device_ids=distributed.ddp_device_ids(env, device),
                         find_unused_parameters=cfg.train.find_unused_parameters,
                         gradient_as_bucket_view=True) if self.ddp else compiled
        self.optimizer = adamw(self.raw_model, cfg.optim, device)
        self.scaler = precision.grad_scaler(self.precision, device)
        seed, workers = cfg.train.seed, cfg.data.num_workers
        self.sampler = ResumableSampler(splits.train, env, seed, shuffle=True, drop_last=True)
        self.train_loader = make_loader(splits.train, self.sampler, cfg.train.batch_size, workers, device,
                                        seed + env.rank, drop_last=True)
        self.val_loader = make_loader(splits.val, EvalShard(splits.val, env), cfg.train.batch_size, workers,
                                      device, seed, drop_last=False)
        self.test_loader = make_loader(splits.test, EvalShard(splits.test, env), cfg.train.batch_size, workers,
                                       device, seed, drop_last=False)
        self.samples_per_micro = cfg.train.batch_size * env.world_size
        self._memory_warned: set[str] = set()
        if len(self.sampler) < cfg.train.batch_size:
            raise TrainingError(f"the training split has {len(splits.train)} samples: too few for "  # type: ignore
                                f"{env.world_size} rank(s) x train.batch_size={cfg.train.batch_size}")

    def fit(self) -> Outcome:
        """Train; a failure we can explain becomes a TrainingError naming its cause, step and fix."""
        try:
            return self._loop()
        except (RuntimeError, ConnectionError) as exc:  # OutOfMemoryError is a RuntimeError
            explained = diagnose.explain(exc, self.state.step + 1, self.env, self.cfg.data.num_workers,
                                         self.cfg.train.collective_timeout_s)
            if explained is exc:
                raise
            raise explained from exc
        finally:
            diagnose.disarm_watchdog()

    def _loop(self) -> Outcome:
        t, first = self.cfg.train, True
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
        bad_loss_seen = torch.zeros((), dtype=torch.bool, device=self.device)
        last_save, busy_s, data_s, tokens_at_log = time.monotonic(), 0.0, 0.0, self.state.tokens_seen
        while self.state.step < t.max_steps:
            watchdog.progress()
            started, step = time.perf_counter(), self.state.step + 1
            lr = lr_at(self.state.step, self.cfg.optim, t.max_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            micro_batches = [next(batches).to(self.device, non_blocking=True) for _ in range(t.grad_accum_steps)]
            data_s += time.perf_counter() - started
            loss_sum = accumulate_gradients(self.model, micro_batches, self.precision, self.scaler)
            self.scaler.unscale_(self.optimizer)
            grad_norm = clip_gradients(self.raw_model, self.cfg.optim.grad_clip)
            bad_loss_seen |= ~torch.isfinite(loss_sum)  # on the device: no sync until the ranks agree
            stop = time_due = False
            if first or step % t.agree_every == 0:
                due = self.env.is_main and bool(self.cfg.checkpoint.every_minutes) and \
                    time.monotonic() - last_save >= 60 * self.cfg.checkpoint.every_minutes
                bad_loss, stop, time_due, unused = distributed.any_flags(
                    [bad_loss_seen, self.stop.requested, due, first and self._has_unused()], self.device)
                if bad_loss or unused:
                    self._fail(step, bad_loss, bool(bad_loss_seen.item()))
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.optimizer.zero_grad(set_to_none=True)
            self.state.step = step
            self.metrics.advance(step)
            self.state.tokens_seen += self.samples_per_micro * t.grad_accum_steps * micro_batches[0].shape[1]
            busy_s += time.perf_counter() - started  # training time only: validation is not throughput
            final = step == t.max_steps
            evaluated = final or (bool(t.eval_every) and step % t.eval_every == 0)
            early_stop = self._validate() if evaluated else False
            if final or early_stop:
                self.state.test_loss = self.evaluate(self.test_loader, 0)
                self.state.outcome = (Outcome.FINISHED if final else Outcome.EARLY_STOPPED).value
            if evaluated or first or step % t.log_every == 0:  # the first step: an early sign of life
                self._log(step, lr, loss_sum, grad_norm, (self.state.tokens_seen - tokens_at_log) / busy_s,
                          data_s / busy_s, evaluated)
                busy_s, data_s, tokens_at_log = 0.0, 0.0, self.state.tokens_seen
            periodic = bool(self.cfg.checkpoint.every_steps) and step % self.cfg.checkpoint.every_steps == 0
            if stop or final or early_stop or time_due or periodic:
                self.save(self.state.val_loss if evaluated else None, blocking=stop or final or early_stop)
                last_save = time.monotonic()
            if stop:
                log.warning("stopping at step %d on %s: checkpoint saved", step,
                            ", ".join(self.stop.received) or "a signal that reached another rank")
                return Outcome.STOPPED_BY_SIGNAL
            if early_stop:
                log.info("early stopping at step %d: val_loss has not improved for %d validations (best %.4f)",
                         step, self.state.evals_since_best, self.state.best_val_loss)
                return Outcome.EARLY_STOPPED
            first = False
        log.info("finished at step %d: val_loss %s, test_loss %s", self.state.step, _fmt(self.state.val_loss),
                 _fmt(self.state.test_loss))
        return Outcome.FINISHED

    def _batches(self) -> Iterator[torch.Tensor]:
        """Micro-batches forever, across epochs, starting at the restored data position."""
        self.sampler.set_position(self.state.epoch, self.state.samples_in_epoch)
        while True:
            for tokens in self.train_loader:
                self.state.samples_in_epoch += self.samples_per_micro
                yield tokens
            self.state.epoch += 1
            self.state.samples_in_epoch = 0
            self.sampler.set_epoch(self.state.epoch)

    def _has_unused(self) -> bool:
        return self.ddp and not self.cfg.train.find_unused_parameters and bool(self._unused_names())

    def _unused_names(self) -> list[str]:
        return [n for n, p in self.raw_model.named_parameters() if p.requires_grad and p.grad is None]

    def _fail(self, step: int, bad_loss: bool, bad_here: bool) -> None:
        """Raise the same diagnosed error on every rank (the collective below is taken by all)."""
        ranks = distributed.flagged_ranks(bad_here if bad_loss else self._has_unused(), self.device)
        if bad_loss:
            checked = "" if self.cfg.train.agree_every == 1 else f" (or up to {self.cfg.train.agree_every - 1} before)"
            raise TrainingError(
                f"the loss became non-finite at step {step}{checked} on rank(s) {ranks}; the step was not applied "
                "and no checkpoint was written. HINT: lower optim.lr or raise optim.warmup_steps, keep "
                "optim.grad_clip on, prefer bf16 to fp16, and check the data; then resume from the last checkpoint")
        names = self._unused_names()
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        raise TrainingError(
            f"{len(names)} parameter(s) received no gradient in step {step} on rank(s) {ranks}: {shown}. DDP "
            "cannot reduce gradients that never arrive. HINT: remove the unused parameters or freeze them "
            "(requires_grad_(False)); if they are unused only on some steps, set train.find_unused_parameters: "
            "true (slower)")

    @torch.no_grad()
    def evaluate(self, loader: Any, max_batches: int) -> float | None:
        """Mean token loss over every rank's shard; each sample counted once, however uneven the shards."""
        self.raw_model.eval()  # the unwrapped model: uneven shards must not trigger DDP's collectives
        total, count = 0.0, 0.0
        for index, tokens in enumerate(loader):
            if max_batches and index >= max_batches:
                break
            tokens = tokens.to(self.device, non_blocking=True)
            with precision.autocast(self.precision, self.device):
                loss = lm_loss(self.raw_model, tokens)
            total += loss.item() * tokens[:, 1:].numel()
            count += tokens[:, 1:].numel()
        self.raw_model.train()
        total, count = distributed.sum_tensor([total, count], self.device)
        return total / count if count else None

    def _validate(self) -> bool:
        """Evaluate; rank 0 alone decides early stopping from the all-reduced loss and broadcasts it."""
        val = self.evaluate(self.val_loader, self.cfg.train.eval_batches)
        s, es = self.state, self.cfg.early_stopping
        decision = None
        if self.env.is_main:
            improved = val is not None and (s.best_val_loss is None or val < s.best_val_loss - es.min_delta)
            best = val if improved else s.best_val_loss
            since = 0 if improved else s.evals_since_best + 1
            decision = (best, since, bool(es.patience) and since >= es.patience)
        s.best_val_loss, s.evals_since_best, stop = distributed.broadcast_from_main(decision)
        s.val_loss = val
        return bool(stop)

    def _log(self, step: int, lr: float, loss_sum: torch.Tensor, grad_norm: torch.Tensor, tok_s: float,
             data_wait: float, evaluated: bool) -> None:
        loss, norm = distributed.sum_tensor([loss_sum.item(), grad_norm.item()], self.device)
        record: dict[str, Any] = {
            "step": step, "epoch": self.state.epoch, "loss": loss / self.env.world_size, "lr": lr,
            "grad_norm": norm / self.env.world_size, "tokens_per_s": tok_s * self.env.world_size,
            "tokens_seen": self.state.tokens_seen, "data_wait_frac": data_wait, "time": time.time(),
            **memory_gb(self.device)}
        self._warn_memory(step, record)
        if evaluated:
            record["val_loss"] = self.state.val_loss
        if self.state.outcome:
            record["test_loss"] = self.state.test_loss
        self.metrics.write(record)
        log.info("step %d/%d epoch %d loss %.4f%s lr %.2e %.0f tok/s", step, self.cfg.train.max_steps,
                 self.state.epoch, record["loss"], f" val_loss {_fmt(self.state.val_loss)}" if evaluated else "",
                 lr, record["tokens_per_s"])

    def _warn_memory(self, step: int, record: dict[str, Any]) -> None:
        """Each rank warns about its own memory, once per quantity that crosses logging.memory_warn_gb."""
        limit = self.cfg.logging.memory_warn_gb
        for key in ("mem_rss_gb", "mem_gpu_peak_gb"):
            if limit and record.get(key, 0.0) > limit and key not in self._memory_warned:
                self._memory_warned.add(key)
                log.warning("rank %d: %s is %.2f GB at step %d, above logging.memory_warn_gb=%.2f",
                            self.env.rank, key, record[key], step, limit)

    def save(self, val_loss: float | None, blocking: bool = False) -> None:
        s = self.state
        self.checkpointer.save(
            s.step, lambda: train_state.replicated_files(self.raw_model, self.optimizer, self.scaler, s,
                                                         self.precision, self.env.world_size),
            train_state.rank_state(s), {"epoch": s.epoch, "val_loss": val_loss, "tokens_seen": s.tokens_seen,
                                        "outcome": s.outcome}, blocking=blocking)

    def restore(self, ckpt: Checkpoint) -> None:
        self.state = train_state.restore(ckpt, self.raw_model, self.optimizer, self.scaler, self.env,
                                         self.cfg.train.seed)
        self.checkpointer.last_step = ckpt.step


def accumulate_gradients(model: nn.Module, micro_batches: list[torch.Tensor], precision_name: str,
                         scaler: torch.amp.GradScaler) -> torch.Tensor:
    """Backward over the micro-batches of one step; the gradient equals one batch k times larger.

    Under DDP gradients are all-reduced on the last micro-step only (no_sync before it). Returns the
    step's mean loss as a device tensor, without synchronizing.
    """
    device = micro_batches[0].device
    loss_sum = torch.zeros((), device=device)
    for index, tokens in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        with model.no_sync() if isinstance(model, DDP) and not last else contextlib.nullcontext():
            with precision.autocast(precision_name, device):
                loss = lm_loss(model, tokens) / len(micro_batches)
            scaler.scale(loss).backward()
        loss_sum += loss.detach()
    return loss_sum


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


