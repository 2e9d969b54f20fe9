"""Tasks for tests, named in configs as 'tests.tasks:<function>' like a user's own: a tiny
regression and classification problem, and variants that break one rule of the Task contract
each."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset

import qgtrain


class Points(Dataset):
    """Point i is made from its own seed; its label says which side of a fixed plane it lies on."""

    def __init__(self, size: int, seed: int) -> None:
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = torch.randn(8, generator=torch.Generator().manual_seed(self.seed * 7919 + index))
        return {"x": x, "label": (x[:3].sum() > 0).long()}


def classify_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(batch["x"]), batch["label"])


def accuracy(
    model: nn.Module, batch: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, int]]:
    return {
        "accuracy": ((model(batch["x"]).argmax(1) == batch["label"]).sum(), len(batch["label"]))
    }


def points(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    size = int(cfg.task.options.get("size", 512))
    dropout = float(cfg.task.options.get("dropout", 0.1))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(dropout), nn.Linear(16, 2))
    return qgtrain.Task(
        model=model,
        train=Points(size, 1),
        val=Points(size // 4 + 3, 2),
        test=Points(37, 3),
        loss=classify_loss,
        metrics=accuracy,
    )


def not_a_task(cfg: qgtrain.RunConfig) -> int:
    return 42


def model_is_not_a_module(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    task = points(cfg)
    task.model = "a model"
    return task


def loss_is_not_a_scalar(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    task = points(cfg)
    task.loss = lambda model, batch: F.cross_entropy(
        model(batch["x"]), batch["label"], reduction="none"
    )
    return task


class Opaque:
    """A batch part qgtrain cannot move: no .to(), not a container it knows."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


def batch_cannot_move(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    task = points(cfg)
    task.collate = lambda samples: {"x": Opaque(torch.stack([s["x"] for s in samples]))}
    return task


def without_metrics(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    task = points(cfg)
    task.metrics = None
    return task


class BadSampleOnRankOne(Points):
    """The dataset fails on rank 1 only, at its 20th sample, as a corrupt record would make it."""

    def __init__(self, size: int, seed: int) -> None:
        super().__init__(size, seed)
        self.reads = 0

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.reads += 1
        if dist.get_rank() == 1 and self.reads == 20:
            raise ValueError("sample 17 has no label")
        return super().__getitem__(index)


def raises_on_rank_one(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    """The loss, the collate or the dataset (task.options.where) fails on rank 1 only, in its third
    training step, as a bad sample would make it."""
    task, where, calls = points(cfg), cfg.task.options.get("where", "loss"), [0]

    def third_step_on_rank_one() -> bool:
        calls[0] += 1
        return dist.get_rank() == 1 and calls[0] == 3

    def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if model.training and third_step_on_rank_one():
            raise ValueError("sample 17 has no label")
        return classify_loss(model, batch)

    def collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if third_step_on_rank_one():
            raise ValueError("sample 17 has no label")
        return torch.utils.data.default_collate(samples)

    if where == "loss":
        task.loss = loss
    elif where == "collate":
        task.collate = collate
    else:
        task.train = BadSampleOnRankOne(len(task.train), 1)
    return task


def killed_at_a_step(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    """Points whose rank task.options.kill_rank SIGKILLs its own process in training step
    task.options.kill_step of a start on two ranks, as the OOM killer would: at an exact step, so
    that a test knows which reports and saves came before it (a kill from outside races the steps
    of a fast run). With task.options.damage (the folder above every node's
    checkpoint.local_dir), rank 0's part of the node-local step before the kill is first damaged
    on every node, as a failing disk leaves it. With task.options.keep_metrics (the run's
    metrics.jsonl), the records up to the kill are copied beside it as first.jsonl: the next start
    cuts the file back to the step it resumes from."""
    task, options, calls = points(cfg), cfg.task.options, [0]
    rank, step = int(options["kill_rank"]), int(options["kill_step"])
    damage, every = options.get("damage"), cfg.checkpoint.local_every_steps
    metrics = options.get("keep_metrics")

    def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if model.training and dist.get_world_size() == 2:
            calls[0] += 1
            if dist.get_rank() == rank and calls[0] == step:
                if damage and isinstance(every, int):
                    damage_local_parts(Path(str(damage)), step // every * every, ranks=2)
                if metrics:
                    keep_records_until(Path(str(metrics)), step - 1)
                os.kill(os.getpid(), signal.SIGKILL)
        return classify_loss(model, batch)

    task.loss = loss
    return task


def damage_local_parts(root: Path, step: int, ranks: int) -> None:
    """Flips a byte in the middle of rank 0's part of node-local `step` in each node's folder
    under `root`, once the step is complete there (every rank's part, its own or a replica: the
    save may still be in the background)."""

    def folders() -> list[Path]:
        found = list(root.glob(f"*/qgtrain-*/step-{step}"))
        done = len(found) == ranks and all(
            (f / f"rank-{r}.json").exists() for f in found for r in range(ranks)
        )
        return found if done else []

    await_(lambda: bool(folders()), f"node-local step {step} complete under {root}")
    for folder in folders():
        part = folder / "rank-0.pt"
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0xFF
        part.write_bytes(bytes(data))


def keep_records_until(path: Path, step: int) -> None:
    """Copies metrics.jsonl to first.jsonl beside it once rank 0 has written `step`'s record."""

    def written() -> bool:
        try:
            last = path.read_text().splitlines()[-1]
            return bool(json.loads(last)["step"] >= step)
        except (OSError, IndexError, ValueError):  # not there yet, or a record being written
            return False

    await_(written, f"step {step}'s record in {path}")
    (path.parent / "first.jsonl").write_text(path.read_text())


def await_(done: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Polls inside a rank, which has no tests.helpers to import."""
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.05)


def vanishes_on_rank_one(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    """Rank 1's process ends while the model is being built, as on a node that is lost: no
    exception, no note, only a peer that is gone."""
    if dist.get_rank() == 1:
        os._exit(137)
    return points(cfg)


@dataclass
class Pair:
    """A dataclass batch, moved field by field."""

    x: torch.Tensor
    label: torch.Tensor


def as_dataclass(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    task = points(cfg)
    task.collate = lambda samples: Pair(
        torch.stack([s["x"] for s in samples]), torch.stack([s["label"] for s in samples])
    )
    task.loss = lambda model, batch: F.cross_entropy(model(batch.x), batch.label)
    task.metrics = lambda model, batch: {
        "accuracy": ((model(batch.x).argmax(1) == batch.label).sum(), len(batch.label))
    }
    return task


def slow_evaluation(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    """Points whose evaluation batches take task.options.eval_batch_s each (a sleep, so the time is
    the same on a busy machine) and whose training steps take task.options.step_s: validations
    longer than many steps, as a large validation split makes them."""
    task, options = points(cfg), cfg.task.options
    eval_batch_s, step_s = float(options.get("eval_batch_s", 0.5)), float(options.get("step_s", 0))
    task.test = Points(int(options.get("test_size", 37)), 3)

    def loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        time.sleep(step_s if model.training else eval_batch_s)
        return classify_loss(model, batch)

    task.loss = loss
    return task


def rank_local_buffer(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    """A buffer that holds the rank it was built on, which DDP is told not to broadcast."""
    task = points(cfg)
    task.model.register_buffer("visits", torch.full((1,), float(dist.get_rank())))
    task.model._ddp_params_and_buffers_to_ignore = ["visits"]
    return task


class Endless(Points):
    """Samples made on the fly without end, as generator datasets report it: len() is
    sys.maxsize."""

    def __len__(self) -> int:
        return sys.maxsize


class Stream(IterableDataset):
    def __iter__(self):  # type: ignore[no-untyped-def]
        return (Points(1, 1)[0] for _ in range(100))

    def __len__(self) -> int:
        return 100


def endless_train(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    task = points(cfg)
    task.train = Endless(1, 1)
    return task


def streamed_val(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    task = points(cfg)
    task.val = Stream()
    return task


class NoisyInEval(nn.Module):
    """Random outputs in eval mode: no reloaded copy can be checked against it."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return out if self.training else out + torch.randn_like(out)


def noisy_in_eval(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    task = points(cfg)
    task.model = NoisyInEval(task.model)
    return task


class Mixer(nn.Module):
    """A block with its own initialisation (truncated normal, orthogonal) and a non-persistent sine
    table."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.gate = nn.Parameter(torch.empty(width, width))
        nn.init.trunc_normal_(self.inner.weight, std=0.02)
        nn.init.orthogonal_(self.gate)
        self.register_buffer(
            "phase", torch.sin(torch.arange(width, dtype=torch.float32)), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.inner(x) @ self.gate + self.phase)


class MixerNet(nn.Module):
    def __init__(self, width: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.Sequential(*[Mixer(width) for _ in range(blocks)])
        self.head = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def drawn_after_model(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    """A task's own model with its own initialisation, and a split of the data drawn from the global
    random generator after the model is built: every rank must draw the same split."""
    model = MixerNet(int(cfg.task.options.get("width", 16)))
    order = torch.randperm(600).tolist()
    data = [Points(600, 1)[i] for i in order]
    return qgtrain.Task(
        model=model, train=data[:500], val=data[500:], loss=classify_loss, metrics=accuracy
    )


def slow_on_rank_zero(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    """Rank 0 takes task.options.build_s to build its task (a large from_pretrained from a shared
    filesystem, say) while the other ranks are done at once and wait for it."""
    if dist.get_rank() == 0:
        time.sleep(float(cfg.task.options.get("build_s", 6)))
    return points(cfg)
