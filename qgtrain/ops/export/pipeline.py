"""`qgtrain export`: a checkpoint as a folder the model's own libraries load, for any model.

Offline and on the CPU (no GPU, no process group): the checkpoint's model is rebuilt as training built it
(from its saved transformers config, its model factory, or by calling its task function again), the
checkpoint's weights are read into it (a sharded checkpoint's shards straight into its tensors), and the one
writer (writer.py) writes it: save_pretrained for a transformers model or a PyTorchModelHubMixin,
model.safetensors for any other module, with the task, config, run facts and a model card. The folder is
then reloaded as a user would (`qgtrain.load_model`, or AutoModelForCausalLM for the built-in language
model) and its outputs compared with the checkpoint's model before it is moved into place. With
`weights="ema"` (`--weights ema`) the trained parameters are their EMA instead (ema.py).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...config import RunConfig
from ...configload import config_from_dict, config_to_dict
from ...data import tokenizer
from ...errors import CheckpointError, QgtrainError
from ...state import checkpoint, ema_files, layout, sharded
from ...state.rundir import RunDir
from ...task import BUILTIN_LM
from ...training.metrics import read_metrics
from ...trust import config_code, not_yours, require
from . import (
    adapter,
    ema,
    rebuild,
    reload,
    stream,
    target,
    writer,
)

log = logging.getLogger("qgtrain")
LM_USAGE = """from transformers import pipeline
generate = pipeline("text-generation", model="path/to/this/folder")
print(generate("def main(", max_new_tokens=40)[0]["generated_text"])"""


@dataclass(frozen=True)
class Exported:
    folder: Path
    checkpoint: Path
    max_logit_diff: float | None  # None: a model too large to be reloaded whole, checked tensor by tensor
    kind: str = "transformers"
    dtype: str = "fp32"
    tensors_checked: int = 0


def export_run(source: Path, out: Path, *, best: bool = False, step: int | None = None,
               force: bool = False, dtype: str | None = None,
               trust_code: bool = False, weights: str = "model", merge: bool = False) -> Exported:
    """Export the latest (or best, or step N) checkpoint of a run directory, or one checkpoint
    folder, in `dtype` (default: export.dtype), its `weights`: model (the trained ones) or ema; a
    LoRA run's adapter folder or merged model (`merge`, export.merge). Its config's factories are
    imported only if built in, if the run is yours (trust.py), or trusted."""
    ckpt = _select(Path(source), best, step)
    _check_weights(ckpt, weights)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # a bar per weight load is noise in a CLI
    out = Path(out)
    if (refused := target.refusal(out, force)) is not None:
        raise QgtrainError(refused)
    saved = yaml_config(ckpt)
    _require_trusted(saved, Path(source), ckpt.path / layout.CONFIG, trust_code)
    chosen = export_dtype(dtype or saved.export.dtype, _trained_precision(ckpt))
    if saved.model.adapter != "none" or merge:  # adapter.py
        return _export_adapter(ckpt, saved, out, merge, force, chosen, weights)
    builtin = saved.task.factory == BUILTIN_LM
    model_facts = _model_facts(ckpt)
    task = None if builtin else rebuild.rebuild_task(saved, empty=True)
    model = task.model if task is not None else rebuild.rebuild_lm(ckpt.path, saved, model_facts, empty=True)
    tensors, read = stream.tensors_to_write(model), stream.checkpoint_reader(ckpt)
    if weights == "ema":
        read = ema.averaged(ckpt, model, read)
    kind = writer.kind_of(model)
    lm = builtin and kind == "transformers"
    staging = _staging(out)
    try:
        facts = {**run_facts(ckpt, saved, (model_facts.get("tokenizer") or "none (the data came from a factory)")
                             if builtin else None), "dtype": chosen, "weights": weights}
        if lm:
            _set_generation_eos(model, model_facts.get("eos_id"))
        builder = f"model.factory {saved.model.factory}" if builtin else f"the task function {saved.task.factory}"
        published = writer.publishable(config_to_dict(saved))
        card = writer.model_card(saved.train.run_name, model, saved.task.factory, facts,
                                        published,
                                        LM_USAGE if lm else writer.usage(kind, model, builder),
                                        "text-generation" if lm else None)
        meta = {"task": saved.task.factory, "options": saved.task.options, "model_facts": model_facts,
                "run": facts, "config": published}
        torch_dtype = stream.DTYPES[chosen]
        def write_weights(folder: Path, size: int) -> list[str]:
            return stream.write_weights(folder, tensors, read, torch_dtype, size)

        writer.write(model, staging, meta, card, task.tokenizer if task is not None else None,
                            weights=write_weights, dtype=torch_dtype)
        if builtin and model_facts.get("tokenizer"):
            tokenizer.save(model_facts["tokenizer"], staging, saved.data.seq_len)
        checked = stream.check_weights(staging, tensors, read, torch_dtype)
        diff = reload.outputs(ckpt, saved, model_facts, task, tensors, read, torch_dtype,
                                    staging, lm)
        _replace(staging, out, force)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("exported %s to %s in %s (%d tensors read back equal%s)", ckpt.path, out, chosen, checked,
             "" if diff is None else f"; largest output difference after reloading: {diff:.3g}")
    return Exported(out, ckpt.path, diff, kind, chosen, checked)


def _trained_precision(ckpt: checkpoint.Checkpoint) -> str | None:
    return checkpoint.load_json(ckpt, layout.STATE).get("precision")


def _export_adapter(ckpt: checkpoint.Checkpoint, saved: RunConfig, out: Path, merge: bool,
                    force: bool, chosen: str, weights: str) -> Exported:
    merge = merge or saved.export.merge
    if saved.model.adapter == "none":
        raise QgtrainError(f"export --merge: {ckpt.path} trained no adapters (model.adapter: "
                           "none); export it without --merge: that is the full model already")
    if weights != "model":
        raise QgtrainError("export --weights ema: a run with adapters is exported by its trained "
                           "adapters; use --weights model")
    staging = _staging(out)
    try:
        kind, diff = adapter.write(ckpt, saved, staging, merge, stream.DTYPES[chosen])
        _replace(staging, out, force)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("exported %s to %s (%s); %s", ckpt.path, out, kind, "checked by names and shapes"
             if diff is None else f"largest output difference after reloading: {diff:.3g}")
    return Exported(out, ckpt.path, diff, kind, "fp32" if not merge else chosen)


def _staging(out: Path) -> Path:
    """A fresh folder beside `out`: the export is written there, moved into place once checked."""
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _check_weights(ckpt: checkpoint.Checkpoint, weights: str) -> None:
    if weights not in ("model", "ema"):
        raise QgtrainError(f"export: weights {weights!r} is not allowed; choose model or ema")
    if weights == "ema" and not ema_files.saved(ckpt):
        raise QgtrainError(f"export --weights ema: {ckpt.path} holds no EMA of the weights (its "
                           "run trained with train.ema_decay 0); export --weights model, or train "
                           "with train.ema_decay above 0, e.g. 0.999")


def _require_trusted(saved: RunConfig, source: Path, config: Path, trust_code: bool) -> None:
    """The code the config names is imported if built in, if the run is yours, or if trusted."""
    named = config_code(saved)
    if trust_code or all(n.builtin() for n in named):
        return
    why_not = not_yours(source, config)
    if why_not is not None:
        require(named, config, why_not=why_not, what="export",
                fix="--trust-code (trust_code=True in Python)")


def export_dtype(setting: str, trained: str | None) -> str:
    """auto: bf16 for a run that trained in bf16 (its natural dtype: what it computed in), else fp32."""
    if setting not in ("auto", "bf16", "fp32"):
        raise QgtrainError(f"export: dtype {setting!r} is not allowed; choose one of auto, bf16, fp32")
    return ("bf16" if trained == "bf16" else "fp32") if setting == "auto" else setting


def _model_facts(ckpt: checkpoint.Checkpoint) -> dict[str, Any]:
    """The task's facts (model.json); none where the checkpoint holds no such file."""
    path = ckpt.path / layout.MODEL_FACTS
    return json.loads(path.read_text()) if path.exists() else {}


def yaml_config(ckpt: checkpoint.Checkpoint) -> RunConfig:
    import yaml

    saved = ckpt.path / layout.CONFIG
    return config_from_dict(yaml.safe_load(saved.read_text()), str(saved))


def _select(source: Path, best: bool, step: int | None) -> checkpoint.Checkpoint:
    """The checkpoint to export: the first of the candidates that verifies, newest first."""
    candidates = _candidates(source, best, step)
    for ckpt in candidates:
        problem = checkpoint.verify(ckpt)
        if problem is None:
            weights = (ckpt.path / layout.MODEL).exists() or sharded.is_sharded_checkpoint(ckpt)
            if not weights or not (ckpt.path / layout.CONFIG).exists():
                raise CheckpointError(f"export: {ckpt.path} has no model weights or config to export")
            return ckpt
        if len(candidates) == 1:
            raise CheckpointError(f"export: {problem}")
        log.warning("skipping checkpoint %s: %s", ckpt.path.name, problem)
    raise CheckpointError(f"export: no checkpoint in {source} verifies (see the warnings above)")


def _candidates(source: Path, best: bool, step: int | None) -> list[checkpoint.Checkpoint]:
    if not source.exists():
        raise QgtrainError(f"export: {source} does not exist; give a run directory or a checkpoint folder")
    direct = checkpoint.read_manifest(source)
    if direct is not None:
        if best or step is not None:
            raise QgtrainError(f"export: {source} is one checkpoint; --best and --step choose within a run directory")
        return [direct]
    root = RunDir(source).checkpoints
    committed = checkpoint.list_committed(root)
    if not committed:
        raise QgtrainError(f"export: {source} holds no committed checkpoint (looked in {root} and for a "
                           f"{checkpoint.MANIFEST} in {source})")
    if step is not None:
        committed = [c for c in committed if c.step == step]
        if not committed:
            steps = ", ".join(str(c.step) for c in checkpoint.list_committed(root))
            raise QgtrainError(f"export: no checkpoint at step {step} in {root}; there are: {steps}")
    elif best:
        scored = [c for c in committed if c.score is not None]
        if not scored:
            raise QgtrainError(f"export --best: no checkpoint in {root} records a validation score")
        committed = [min(scored, key=lambda c: (c.score, -c.step))]
    return list(reversed(committed))


def _replace(staging: Path, out: Path, force: bool) -> None:
    """Move the verified export into place; a replaced folder goes only once the new one is there.
    `out` is checked again: files may have arrived there while the export was written."""
    if (refused := target.refusal(out, force)) is not None:
        raise QgtrainError(refused)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.rename(out, old)
    os.rename(staging, out)
    if old.is_symlink():  # --out was a link to an earlier export: the link goes, not its target
        old.unlink()
    else:
        shutil.rmtree(old, ignore_errors=True)


def _set_generation_eos(model: torch.nn.Module, eos: int | None) -> None:
    generation = getattr(model, "generation_config", None)
    if eos is not None and generation is not None:
        generation.eos_token_id = eos
        generation.pad_token_id = eos


def run_facts(ckpt: checkpoint.Checkpoint, cfg: RunConfig, tokenizer_name: str | None) -> dict[str, Any]:
    """What training did, from the checkpoint and the run's metrics: in the model card and
    qgtrain_model.json (the checkpoint by its folder's name: its full path names the user's home and
    cluster)."""
    state = checkpoint.load_json(ckpt, layout.STATE)
    trainer, versions = state["trainer"], state.get("versions", {})
    metrics = RunDir(ckpt.path.parent.parent).metrics
    losses = [r["loss"] for r in read_metrics(metrics) if "loss" in r and r["step"] <= ckpt.step] \
        if metrics.exists() else []
    return {"qgtrain": versions.get("qgtrain", "?"), "torch": versions.get("torch", "?"),
            "checkpoint": ckpt.path.name, "step": ckpt.step, "epochs": trainer["epoch"] + 1,
            "tokens_seen": trainer.get("tokens_seen"), "train_loss": losses[-1] if losses else None,
            "val": trainer.get("val_metrics", {"loss": trainer.get("val_loss")}),
            "test": trainer.get("test_metrics", {"loss": trainer.get("test_loss")}),
            "precision": state.get("precision", "?"), "ranks": state.get("world_size", "?"),
            "parallel": cfg.train.parallel, "tokenizer": tokenizer_name}
