"""What a logged step reports: the loss, gradient norm and tokens summed over ranks in one
collective, throughput over the training since the last report, memory, utilisation, and the latest
evaluations."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..foundation.task import ReadyTask
from ..runtime import distributed
from ..runtime.rendezvous import DistEnv
from ..state.train_state import TrainState
from .flops import utilisation
from .metrics import MetricsLog, format_metrics, memory_gb, prefixed
from .timing import Interval

log = logging.getLogger("qgtrain")


class Reporter:
    def __init__(
        self,
        task: ReadyTask,
        metrics: MetricsLog,
        env: DistEnv,
        device: torch.device,
        samples_per_step: int,
        max_steps: int,
        peak_flops: float | None,
        source_counts: Callable[[], dict[str, int]] | None = None,
    ) -> None:
        self.task, self.metrics, self.env, self.device = task, metrics, env, device
        # data.mix: this rank's samples of each source so far, summed over ranks as samples_<name>
        self.source_counts = source_counts
        # of one rank's device, in the run's precision (training/flops.py)
        self.peak_flops = peak_flops
        self.samples_per_step, self.max_steps = samples_per_step, max_steps
        self.pending_tokens = 0  # this rank's tokens since they were last summed over ranks

    def tokens_in(self, micro_batches: list[Any]) -> int:
        """The tokens of a step's micro-batches as the loader gave them, before they move to the
        device: a count that reads a tensor (an attention mask's sum) then waits for no GPU. Added
        to pending_tokens once the step is taken (a dropped batch counts nothing)."""
        if self.task.tokens is None:
            return 0
        return sum(int(self.task.tokens(batch)) for batch in micro_batches)

    def taken(self, tokens: int) -> None:
        """A step taken: its tokens count (tokens_in), pending until settled over the ranks."""
        self.pending_tokens += tokens

    def forget_pending(self) -> None:
        """The steps since the last checkpoint were undone (a rollback): that checkpoint's count
        stands."""
        self.pending_tokens = 0

    def settle_tokens(self, state: TrainState) -> None:
        """Sum what every rank has pending into the run's count (a collective: before a
        checkpoint)."""
        if self.task.tokens is not None:
            pending = torch.tensor(
                [float(self.pending_tokens)], dtype=torch.float64, device=self.device
            )
            state.tokens_seen, self.pending_tokens = (
                state.tokens_seen + int(distributed.sum_tensors(pending)[0]),
                0,
            )

    def report_evaluation(self, state: TrainState) -> None:
        """The final validation and test of a run whose last step was trained by an earlier
        allocation."""
        record = {
            "step": state.step,
            "epoch": state.epoch,
            **prefixed("val", state.val_metrics),
            **state.eval_metrics,
            **prefixed("test", state.test_metrics),
            "time": time.time(),
        }
        self.metrics.write(record)
        log.info(
            "step %d/%d %s",
            state.step,
            self.max_steps,
            format_metrics(
                {k: v for k, v in record.items() if k.startswith(("val", "eval", "test"))}
            ),
        )

    def report(
        self,
        state: TrainState,
        lr: float,
        loss_sum: torch.Tensor,
        grad_norm: torch.Tensor,
        interval: Interval,
        evaluated: bool,
    ) -> None:
        """All-reduce the step's loss, gradient norm and tokens in one collective, and write the
        record."""
        world = self.env.world_size
        pending = torch.tensor(float(self.pending_tokens), dtype=torch.float64, device=self.device)
        counts = self.source_counts() if self.source_counts is not None else {}
        sources = torch.tensor(list(counts.values()), dtype=torch.float64, device=self.device)
        own = torch.stack([loss_sum.double(), grad_norm.double(), pending])
        summed = distributed.sum_tensors(torch.cat([own, sources]))
        loss, norm, tokens = summed[:3]
        state.tokens_seen, self.pending_tokens = state.tokens_seen + int(tokens), 0
        samples_per_s = interval.steps * self.samples_per_step / interval.busy_s
        record: dict[str, Any] = {
            "step": state.step,
            "epoch": state.epoch,
            "loss": loss / world,
            "lr": lr,
            "grad_norm": norm / world,
            "samples_per_s": samples_per_s,
        }
        record.update(
            {f"samples_{name}": int(n) for name, n in zip(counts, summed[3:], strict=True)}
        )
        if self.task.tokens is not None:
            record.update(tokens_per_s=tokens / interval.busy_s, tokens_seen=state.tokens_seen)
        record.update(
            **_time_shares(interval.shares or {}),
            data_wait_frac=interval.data_s / interval.busy_s,
            time=time.time(),
            **memory_gb(self.device),
            **utilisation(self.task.flops_per_sample, samples_per_s, self.peak_flops, world),
        )
        self.metrics.warn_memory(self.env.rank, state.step, record)
        evaluation = {**prefixed("val", state.val_metrics), **state.eval_metrics}
        if evaluated:
            record.update(evaluation)
        if state.outcome:
            record.update(prefixed("test", state.test_metrics))
        self.metrics.write(record)
        speed = (
            f"{record['tokens_per_s']:.0f} tok/s" if tokens else f"{samples_per_s:.1f} samples/s"
        )
        log.info(
            "step %d/%d epoch %d loss %.4f%s lr %.2e %s",
            state.step,
            self.max_steps,
            state.epoch,
            record["loss"],
            f" {format_metrics(evaluation)}" if evaluated else "",
            lr,
            speed,
        )


def _time_shares(shares: dict[str, float]) -> dict[str, float]:
    """The run's time as metrics: `goodput` (training's share) and `time_<kind>` for the others,
    which add up to 1 with it, so a tracker or `qgtrain plot` shows where the time went."""
    if not shares:
        return {}
    return {"goodput": shares["training"]} | {
        f"time_{kind}": share for kind, share in shares.items() if kind != "training"
    }
