"""Rebuilding a run's model as training built it, and checking a reloaded copy against it.

A task's model comes back by calling the task function again with the run's config (in a one-process
group on the CPU, unless the caller already has a group, with the run's seed and the caller's random
state kept), so it is exactly the module that was trained, head and all. The built-in causal LM's
model comes from model.* and the facts its checkpoint recorded. A reloaded export is run on a batch
of the task's own data (or on tokens, for a language model): every output tensor must match the
checkpoint's model.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...foundation.errors import QgtrainError
from ...foundation.task import BUILTIN_LM, ReadyTask
from ...runtime import distributed, rng
from ...runtime.rendezvous import DistEnv
from ...state import layout
from ...tasks.build import build_task
from ...tasks.empty_weights import building_empty, to_meta
from ...tasks.models import build_model

log = logging.getLogger("qgtrain")
MAX_OUTPUT_DIFF = 1e-4


@contextlib.contextmanager
def _group() -> Iterator[None]:
    """A one-process group for the task function (which may ask for its rank), unless there is
    one."""
    if dist.is_available() and dist.is_initialized():
        yield
        return
    with distributed.process_group(DistEnv(), torch.device("cpu"), 60.0, 600.0):
        yield


def rebuild_task(cfg: Any, empty: bool = False) -> ReadyTask:
    """The task of a run's config, its model freshly built on the CPU in fp32, as training built it;
    `empty`: without weights, as the ranks but 0 of a sharded run build it
    (tasks/empty_weights.py)."""
    kept = rng.capture()
    try:
        with _group():
            rng.seed_everything(cfg.train.seed)
            return build_task(cfg, empty=empty)
    finally:
        rng.restore(kept)


def rebuild_model(cfg: Any, facts: dict[str, Any], empty: bool = False) -> nn.Module:
    """The untrained model of a run: its task's, or the built-in causal LM's from model.* and
    `facts`."""
    if cfg.task.factory != BUILTIN_LM:
        return rebuild_task(cfg, empty).model
    kept = rng.capture()
    try:
        rng.seed_everything(cfg.train.seed)
        with building_empty() if empty else contextlib.nullcontext():
            model = build_model(
                cfg.model, facts.get("vocab_size", 257), cfg.data.seq_len, facts.get("eos_id")
            )
        if empty:
            to_meta(model)
        return model
    finally:
        rng.restore(kept)


def rebuild_lm(ckpt_dir: Path, cfg: Any, facts: dict[str, Any], empty: bool = False) -> nn.Module:
    """The built-in language model: from the transformers config its checkpoint saved, or its
    factory; `empty`: without weights."""
    if (ckpt_dir / layout.HF_CONFIG).exists():
        import transformers

        hf = json.loads((ckpt_dir / layout.HF_CONFIG).read_text())
        config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
        with building_empty(meta=True) if empty else contextlib.nullcontext():
            return transformers.AutoModelForCausalLM.from_config(config)
    return rebuild_model(cfg, facts, empty)


def verify(
    model: nn.Module, reloaded: nn.Module, run: Callable[[nn.Module], None], folder: Path
) -> float:
    """The largest difference between every tensor the two models' forwards return under `run`."""
    return verify_against(outputs(model, run), reloaded, run, folder)


def verify_against(
    expected: list[torch.Tensor],
    reloaded: nn.Module,
    run: Callable[[nn.Module], None],
    folder: Path,
) -> float:
    """As `verify`, against outputs taken before (of a model since changed in place: a merge)."""
    got = outputs(reloaded, run)
    if len(expected) != len(got) or not expected:
        raise QgtrainError(
            f"export: the reloaded model in {folder} returned {len(got)} tensor(s), the "
            f"checkpoint's {len(expected)}; the export was not kept"
        )
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(expected, got))
    if not diff <= MAX_OUTPUT_DIFF:
        raise QgtrainError(
            f"export: the reloaded model's outputs differ from the checkpoint's by {diff:.3g} "
            f"(more than {MAX_OUTPUT_DIFF}); the export in {folder} was not kept. HINT: a model "
            "whose outputs are random in eval mode cannot be checked; make its eval forward "
            "deterministic"
        )
    return diff


def task_batch(task: ReadyTask) -> Callable[[nn.Module], None]:
    """Run the task's loss on a few samples of its validation split (or training split)."""
    split = task.val if task.val is not None and len(task.val) else task.train
    batch = task.collate([split[i] for i in range(min(4, len(split)))])
    return lambda model: task.loss(model, batch)


def token_batch(seq_len: int, vocab_size: int) -> Callable[[nn.Module], None]:
    tokens = torch.arange(min(seq_len, 64)).unsqueeze(0) % vocab_size
    return lambda model: model(input_ids=tokens)


@torch.no_grad()
def outputs(model: nn.Module, run: Callable[[nn.Module], None]) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda module, args, out: seen.extend(_tensors(out)))
    try:
        run(model.eval())
    finally:
        hook.remove()
    return seen


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "logits"):  # a transformers ModelOutput
        return _tensors(value.logits)
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []
