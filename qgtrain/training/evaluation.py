"""Validation and test: the loss and the task's metrics, exact over the whole split on any world
size.

Every rank evaluates its own shard (each sample exactly once, so shards may be uneven) and keeps
sums and counts where they are: tensors on the device, Python numbers (a batch's size, a count the
task reports as an int) in host floats, so that no batch waits for a host-to-device copy of a
number. One all-reduce of those sums at the end gives every rank the same values. A metric is sum /
count of all ranks together, never a mean of per-rank means.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..config import EarlyStoppingConfig
from ..data.batches import to_device
from ..foundation.errors import TaskError
from ..runtime import objects
from ..runtime.precision import autocast


@torch.no_grad()
def evaluate(
    model: nn.Module,
    loader: Any,
    loss_fn: Callable[[Any, Any], Any],
    metrics_fn: Callable[[nn.Module, Any], Mapping[str, tuple[Any, Any]]] | None,
    device: torch.device,
    precision_name: str,
    max_batches: int,
    lockstep: bool = False,
) -> dict[str, float | None]:
    """{"loss": mean loss per sample, name: sum / count for each metric}, the same on every rank.

    `model` must be the unwrapped module: DDP's forward would start collectives that uneven shards
    cannot match. A sharded (FSDP) model gathers its weights in every forward, so there all ranks
    run in `lockstep`: as many batches as the largest shard, a rank whose shard has ended repeating
    a batch whose results it drops. A collective: every rank calls it, also one whose shard is
    empty. `precision_name` is what autocast computes in: the strategy's (parallel/strategy.py),
    fp32 for a sharded model, which computes in its FSDP policy's dtype.
    """
    sizes = _batch_sizes(loader)
    own = min(len(sizes), max_batches) if max_batches else len(sizes)
    rounds = _most_batches(own, device) if lockstep else own
    sums: dict[str, list[torch.Tensor]] = {"loss": [_zero(device), _zero(device)]}
    host: dict[str, list[float]] = {"loss": [0.0, 0.0]}
    was_training = model.training
    model.eval()
    try:
        batches, batch = iter(loader), None
        for index in range(rounds):
            if index < own:
                batch = to_device(next(batches), device)
            elif batch is None:  # an empty shard: any sample will do, its results are dropped
                batch = to_device(loader.collate_fn([loader.dataset[0]]), device)
            with autocast(precision_name, device):
                loss = loss_fn(model, batch)
                reported = metrics_fn(model, batch) if metrics_fn is not None else {}
            if index >= own:
                continue
            sums["loss"][0] += loss.detach().double() * sizes[index]
            host["loss"][1] += sizes[index]
            for name, pair in _checked(reported).items():
                for part, value in enumerate(pair):
                    _add(sums, host, name, part, value, device)
    finally:
        model.train(was_training)
    names = _agreed_names({**sums, **host})
    zeros = [_zero(device), _zero(device)]
    flat = torch.stack([value for name in names for value in sums.get(name, zeros)])
    # the host's part: one copy for the whole evaluation
    flat += torch.tensor(
        [value for name in names for value in host.get(name, [0.0, 0.0])], dtype=torch.float64
    ).to(device)
    dist.all_reduce(flat)
    totals = flat.tolist()
    return {
        name: (totals[2 * i] / totals[2 * i + 1] if totals[2 * i + 1] else None)
        for i, name in enumerate(names)
    }


def decide_early_stop(
    es: EarlyStoppingConfig, value: float | None, best: float | None, evals_since_best: int
) -> tuple[float | None, int, bool]:
    """(best so far, validations since it, whether to stop) after a validation that gave `value`."""
    sign = 1.0 if es.mode == "min" else -1.0
    improved = value is not None and (best is None or sign * value < sign * best - es.min_delta)
    since = 0 if improved else evals_since_best + 1
    return (value if improved else best), since, bool(es.patience) and since >= es.patience


def _add(
    sums: dict[str, list[torch.Tensor]],
    host: dict[str, list[float]],
    name: str,
    part: int,
    value: Any,
    device: torch.device,
) -> None:
    """Add a metric's sum (part 0) or count (part 1): a Python number on the host, anything else (a
    tensor, an array) on the device."""
    if isinstance(value, (int, float)):  # bool too
        host.setdefault(name, [0.0, 0.0])[part] += float(value)
    else:
        acc = sums.setdefault(name, [_zero(device), _zero(device)])
        acc[part] += torch.as_tensor(value, device=device).double().sum()


def _zero(device: torch.device) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float64, device=device)


def _most_batches(own: int, device: torch.device) -> int:
    """The largest shard's batch count: the rounds every rank of a sharded model runs."""
    most = torch.tensor([own], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


def _batch_sizes(loader: Any) -> list[int]:
    """Samples in each batch of this rank's shard, known without looking inside the batches."""
    total, size = len(loader.sampler), loader.batch_size
    return [min(size, total - start) for start in range(0, total, size)]


def _checked(reported: Any) -> Mapping[str, tuple[Any, Any]]:
    if not isinstance(reported, Mapping) or not all(
        isinstance(k, str) and isinstance(v, (tuple, list)) and len(v) == 2
        for k, v in reported.items()
    ):
        shown = f"{type(reported).__name__} {str(reported)[:80]}"
        raise TaskError(
            f"task: metrics(model, batch) returned {shown}; expected a dict of name -> "
            "(sum, count), e.g. {'accuracy': (correct, samples)}"
        )
    if "loss" in reported:
        raise TaskError(
            "task: metrics(model, batch) reports 'loss', which qgtrain computes from "
            "Task.loss; give the metric another name"
        )
    return reported


def _agreed_names(sums: Mapping[str, object]) -> list[str]:
    """The metric names of all ranks, in one order: a rank whose shard was empty reported none."""
    if dist.get_world_size() == 1:
        return ["loss", *sorted(set(sums) - {"loss"})]
    everyone = objects.all_gather(sorted(sums), what="metric names")
    return ["loss", *sorted(set().union(*everyone) - {"loss"})]
