"""Calling the task function the config names, and checking what it returns before any rank trains.

A task is user code: everything qgtrain can check without running a step is checked here, on every
rank alike, so a mistake ends the job with one line naming the task and the part, not a traceback
from inside the loop. The defaults (torch's collate, the model's own `.loss`) are filled in here
too.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset, default_collate

from ..config import RunConfig
from ..data.stream.kinds import is_stream
from ..foundation.errors import ConfigError, TaskError
from ..foundation.factory import load_factory
from ..foundation.task import ReadyTask, Task
from ..runtime import distributed
from . import lm_shape, warm_imports
from .empty_weights import building_empty, to_meta

logger = logging.getLogger("qgtrain")
TaskSource = Task | Callable[[RunConfig], Task]


def build_task(
    cfg: RunConfig,
    given: TaskSource | None = None,
    *,
    empty: bool = False,
    resumed_from: Path | None = None,
) -> ReadyTask:
    """The task of `cfg.task.factory` (or the Task or task function given in Python), checked, with
    its defaults filled in. `empty`: its model's parameters on the meta device
    (empty_weights.py). `resumed_from`: the checkpoint a run resumes, whose model facts build the
    built-in model as the run began (lm_shape.py)."""
    warm_imports.wait()
    if given is None:
        spec = cfg.task.factory
        factory = load_factory(spec, "task.factory")
    else:
        spec = (
            "the Task given in Python"
            if isinstance(given, Task)
            else getattr(given, "__qualname__", repr(given))
        )
        factory = (lambda _: given) if isinstance(given, Task) else given
    resumed = lm_shape.saved_facts(resumed_from) if resumed_from else None
    with lm_shape.resuming(resumed):
        made = _fail_together(lambda: _call_empty(factory, cfg) if empty else factory(cfg), cfg)
    if not isinstance(made, Task):
        raise TaskError(
            f"task.factory: {spec} returned {type(made).__name__}, not a "
            "qgtrain.Task. HINT: return qgtrain.Task(model=..., train=..., val=..., "
            "loss=...)"
        )
    check_task(made, spec, cfg)
    filled = {"collate": made.collate or default_collate, "loss": made.loss or model_loss}
    return ReadyTask(
        **{**{f.name: getattr(made, f.name) for f in dataclasses.fields(Task)}, **filled}
    )


def _call_empty(factory: Callable[[RunConfig], Any], cfg: RunConfig) -> Any:
    with building_empty():
        made = factory(cfg)
    if isinstance(made, Task) and isinstance(made.model, nn.Module):
        to_meta(made.model)
    return made


def _fail_together(work: Callable[[], Any], cfg: RunConfig) -> Any:
    """Run `work` on every rank; a QgtrainError on any rank is raised on all of them (the lowest
    rank's), so work that differs between ranks (only rank 0 reads a pretrained model) cannot leave
    the others waiting in the next collective for a rank that has gone. That work can take rank 0
    far longer than the others: they wait for it up to train.startup_timeout_s."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return work()
    result, failure = distributed.attempt(work)
    with distributed.collectives_wait(
        cfg.train.startup_timeout_s, then=cfg.train.collective_timeout_s
    ):
        distributed.fail_together(failure, "task build")
    return result


def task_spec(given: TaskSource) -> str | None:
    """How the config can name a task function given in Python, so that a requeued job, `qgtrain
    train` and `qgtrain export` rebuild the same task: 'module:function', or 'file.py:function' for
    a script."""
    name = getattr(given, "__qualname__", "")
    # an object, a lambda or a nested function
    if isinstance(given, Task) or not name or "<" in name:
        return None
    if given.__module__ == "__main__":
        path = getattr(sys.modules["__main__"], "__file__", None)
        return f"{Path(path).resolve()}:{name}" if path else None
    return f"{given.__module__}:{name}"


def check_task(task: Task, spec: str, cfg: RunConfig) -> None:
    def fail(problem: str) -> None:
        raise TaskError(f"task.factory: the task of {spec} {problem}")

    if not isinstance(task.model, nn.Module):
        fail(f"has model={type(task.model).__name__}; it must be a torch.nn.Module")
    if not any(p.requires_grad for p in task.model.parameters()):
        fail("has a model with no trainable parameters")
    for split in ("train", "val", "test"):
        dataset = getattr(task, split)
        if (dataset is not None or split == "train") and (problem := split_problem(split, dataset)):
            fail(f"has {split}={type(dataset).__name__}, {problem}")
    if not is_stream(task.train) and len(task.train) == 0:
        fail("has an empty train dataset")
    for part in ("collate", "loss", "metrics", "tokens", "optimizer"):
        value = getattr(task, part)
        if value is not None and not callable(value):
            fail(f"has {part}={type(value).__name__}, which cannot be called")
    # the config asks for what the task lacks: a config error, as either may change
    es = cfg.early_stopping
    if es.metric.startswith("eval_"):  # eval.tasks' figures: checked against them by the config
        return
    if task.val is None and (es.patience or es.metric != "val_loss"):
        raise ConfigError(
            f"early_stopping: the task of {spec} has no val dataset, but early "
            f"stopping follows {es.metric}; give the task a val split or turn early "
            "stopping off (early_stopping.patience: 0)"
        )
    if es.metric != "val_loss" and task.metrics is None:
        raise ConfigError(
            f"early_stopping.metric: the task of {spec} reports no metrics, but "
            f"early_stopping.metric is {es.metric}; add a metrics function or use "
            "val_loss"
        )


def split_problem(split: str, dataset: Any) -> str | None:
    """Why qgtrain cannot train on (train) or evaluate (val, test) this split, or None."""
    if is_stream(dataset):  # a training stream resumes by its own position (data/stream/)
        return (
            None
            if split == "train"
            else (
                "an IterableDataset; validation and test splits must be map-style (__len__ and "
                "__getitem__: every sample evaluated exactly once over all ranks), or None. HINT: "
                "streams are for the train split; give a held-out map-style split (a list of "
                "samples will do)"
            )
        )
    problem = resumable_problem(dataset)
    if problem is None:
        return None
    return (
        f"{problem}; it must be a map-style dataset (__len__ and __getitem__: resuming at an "
        "exact sample needs indices)"
        + (", or None" if split != "train" else ", or a torch IterableDataset (a stream)")
        + ". HINT: give a map-style view (sample i made or read from index i), or for text the "
        "data files (data.name: files)"
    )


def resumable_problem(dataset: Any) -> str | None:
    """Why qgtrain cannot resume this map-style dataset at an exact sample, or None. An
    IterableDataset has no index to resume at (a training stream is resumed by its position
    instead: data/stream/streams.py); generators that make samples on the fly report len() ==
    sys.maxsize, an endless length no epoch or sampler can be built on."""
    if isinstance(dataset, IterableDataset):
        return "an IterableDataset (a stream, without indices)"
    if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        return "without __len__ and __getitem__"
    try:
        size = len(dataset)
    except (TypeError, NotImplementedError, OverflowError) as exc:
        return f"whose len() fails ({type(exc).__name__}: {exc})"
    if size >= sys.maxsize:
        return f"whose len() is {size} (sys.maxsize: an endless stream, not a count of samples)"
    return None


def model_loss(model: nn.Module, batch: Any) -> Any:
    """The default loss: what the model returns as `loss` (Hugging Face models, when the batch has
    labels)."""
    out = model(**batch) if isinstance(batch, Mapping) else model(batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if loss is None:
        raise TaskError(
            f"task: the model returned {type(out).__name__} without a loss. HINT: put "
            "labels in the batch (Hugging Face models then compute the loss), or give "
            "the task a loss function"
        )
    return loss


def naming_the_task(cfg: RunConfig, task: TaskSource | None) -> RunConfig:
    """The config names a task given in Python, so a requeued job and `qgtrain export` rebuild it
    (done before the config is recorded: the run's copies must agree)."""
    if task is not None and (spec := task_spec(task)):
        return dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, factory=spec))
    if task is not None:
        logger.warning(
            "the task was given as an object, so the run's config cannot name it: a requeued job, "
            "`qgtrain train` and `qgtrain export` would build %s instead. HINT: pass the function "
            "that makes the Task (task=my_task), defined at the top level of a module",
            cfg.task.factory,
        )
    return cfg
