"""Rebuilding a run's model as training built it, and checking a reloaded copy against it.

A task's model comes back by calling the task function again with the run's config (in a one-process
group on the CPU, unless the caller already has a group, with the run's seed and the caller's random
state kept), so it is exactly the module that was trained, head and all. The built-in causal LM's
model comes from model.* and the facts its checkpoint recorded. A reloaded export is run on a batch
of the task's own data (or on tokens, for a language model): every output tensor must match the
checkpoint's model. A model whose vocabulary was padded (lm_shape.py) is exported with the rows of
the real vocabulary only (`as_exported`, `unpadded`), so transformers loads it with the
tokenizer's vocabulary size and gives the trained model's logits.
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
from ...tasks import lm_shape
from ...tasks.build import build_task
from ...tasks.empty_weights import building_empty, to_meta
from ...tasks.models import build_model
from .safetensors_io import Reader, tensors_to_write

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


def rebuild_task(cfg: Any, empty: bool = False, checkpoint: Path | None = None) -> ReadyTask:
    """The task of a run's config, its model freshly built on the CPU in fp32, as training built it
    (from `checkpoint`'s model facts, where given); `empty`: without weights, as the ranks but 0 of
    a sharded run build it (tasks/empty_weights.py)."""
    kept = rng.capture()
    try:
        with _group():
            rng.seed_everything(cfg.train.seed)
            return build_task(cfg, empty=empty, resumed_from=checkpoint)
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
                cfg.model,
                facts.get("vocab_size", 257),
                cfg.data.seq_len,
                facts.get("eos_id"),
                lm_shape.from_facts(facts),
            )
        if empty:
            to_meta(model)
        return model
    finally:
        rng.restore(kept)


def rebuild_lm(
    ckpt_dir: Path,
    cfg: Any,
    facts: dict[str, Any],
    empty: bool = False,
    as_exported: bool = False,
) -> nn.Module:
    """The built-in language model: from the transformers config its checkpoint saved, or its
    factory; `empty`: without weights; `as_exported`: its vocabulary unpadded."""
    if (ckpt_dir / layout.HF_CONFIG).exists():
        import transformers

        hf = json.loads((ckpt_dir / layout.HF_CONFIG).read_text())
        if as_exported and padded(facts):
            hf["vocab_size"] = facts["vocab_size"]
        config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
        with building_empty(meta=True) if empty else contextlib.nullcontext():
            return transformers.AutoModelForCausalLM.from_config(config)
    return rebuild_model(cfg, facts, empty)


def padded(facts: dict[str, Any]) -> bool:
    return int(facts.get("padded_vocab") or 0) > int(facts.get("vocab_size") or 0)


def unpadded(
    ckpt_dir: Path,
    cfg: Any,
    facts: dict[str, Any],
    trained: dict[str, torch.Tensor],
    read: Reader,
    model: nn.Module,
) -> tuple[nn.Module, dict[str, torch.Tensor], Reader]:
    """The built-in model as exported (without weights), its tensors, and `read` answering them:
    the model and `read` themselves unless its vocabulary was padded (`trained`: the tensors of the
    model as trained, `read` their reader)."""
    if not padded(facts):
        return model, trained, read
    exported = rebuild_lm(ckpt_dir, cfg, facts, empty=True, as_exported=True)
    return exported, tensors_to_write(exported), unpadded_reader(read, trained, facts)


def unpadded_reader(
    read: Reader, trained: dict[str, torch.Tensor], facts: dict[str, Any]
) -> Reader:
    """`read` (of the checkpoint's tensors, `trained` as the model trained names and shapes them),
    answering the exported model's tensors: those of a padded vocabulary cut to its real rows.
    Asked with the trained model's own tensors, so a reader that finds tensors by identity (the
    EMA's) finds them."""
    vocab = int(facts["vocab_size"])

    def read_unpadded(wanted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        got = read({name: trained[name] for name in wanted})
        return {
            name: got[name][:vocab] if got[name].shape[:1] != tensor.shape[:1] else got[name]
            for name, tensor in wanted.items()
        }

    return read_unpadded


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
