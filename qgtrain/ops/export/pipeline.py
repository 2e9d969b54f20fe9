"""`qgtrain export`: a checkpoint as a folder the model's own libraries load, for any model.

Offline and on the CPU (no GPU, no process group): the checkpoint's model is rebuilt as training
built it (from its saved transformers config, its model factory, or by calling its task function
again), the checkpoint's weights are read into it (a sharded checkpoint's shards straight into its
tensors), and the one writer (writer.py) writes it: save_pretrained for a transformers model or a
PyTorchModelHubMixin, model.safetensors for any other module, with the task, config, run facts and a
model card, and a task file's code with it (bundle.py). The folder is then reloaded as a user would
(`qgtrain.load_model`, or AutoModelForCausalLM for the built-in language model) and its outputs
compared with the checkpoint's model before it is moved into place. With `weights="ema"` (`--weights
ema`) the trained parameters are their EMA instead (ema.py).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...config import RunConfig
from ...config.load import config_to_dict
from ...data import tokenizer
from ...foundation.errors import QgtrainError
from ...foundation.folder_code import trusting_its_flag
from ...foundation.task import BUILTIN_LM
from ...foundation.trust import config_code, not_yours, require
from ...state import checkpoint, layout
from . import adapter, bundle, ema, origin, rebuild, reload, safetensors_io, target, writer

log = logging.getLogger("qgtrain")
LM_USAGE = """from transformers import pipeline
generate = pipeline("text-generation", model="path/to/this/folder")
print(generate("def main(", max_new_tokens=40)[0]["generated_text"])"""

ADAPTER_USAGE = """import transformers
from peft import PeftModel
base = transformers.AutoModelForCausalLM.from_pretrained("path/to/{base}")
model = PeftModel.from_pretrained(base, "path/to/this/folder")"""


@dataclass(frozen=True)
class Exported:
    folder: Path
    checkpoint: Path
    # None: a model too large to be reloaded whole, checked tensor by tensor
    max_logit_diff: float | None
    kind: str = "transformers"
    dtype: str = "fp32"
    tensors_checked: int = 0


@trusting_its_flag("--trust-code (trust_code=True in Python)")  # folder_code.py
def export_run(
    source: Path,
    out: Path,
    *,
    best: bool | str = False,
    step: int | None = None,
    force: bool = False,
    dtype: str | None = None,
    trust_code: bool = False,
    weights: str = "model",
    merge: bool = False,
) -> Exported:
    """Export the latest (or best, or step N) checkpoint of a run directory, or one checkpoint
    folder, in `dtype` (default: export.dtype), its `weights`: model (the trained ones) or ema; a
    LoRA run's adapter folder or merged model (`merge`, export.merge). Its config's factories are
    imported only if built in, if the run is yours (trust.py), or trusted."""
    out = Path(out)
    ckpt, saved, chosen = _opened(Path(source), out, best, step, force, dtype, trust_code, weights)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # a bar per weight load is noise in a CLI
    if saved.model.adapter != "none" or merge:  # adapter.py
        return _export_adapter(ckpt, saved, out, merge, force, chosen, weights)
    builtin = saved.task.factory == BUILTIN_LM
    model_facts = origin.model_facts(ckpt)
    task = None if builtin else rebuild.rebuild_task(saved, empty=True)
    model = (
        task.model
        if task is not None
        else rebuild.rebuild_lm(ckpt.path, saved, model_facts, empty=True)
    )
    tensors, read = safetensors_io.tensors_to_write(model), safetensors_io.checkpoint_reader(ckpt)
    if weights == "ema":
        read = ema.averaged(ckpt, model, read)
    if task is None:  # a padded vocabulary is exported with its real rows only
        model, tensors, read = rebuild.unpadded(ckpt.path, saved, model_facts, tensors, read, model)
    kind = writer.kind_of(model)
    lm = builtin and kind == "transformers"
    staging = target.staging(out)
    try:
        if lm:
            _set_generation_eos(model, model_facts.get("eos_id"))
        card, meta = _card_and_meta(ckpt, saved, staging, model, model_facts, chosen, weights, kind)
        torch_dtype = safetensors_io.DTYPES[chosen]

        def write_weights(folder: Path, size: int) -> list[str]:
            return safetensors_io.write_weights(folder, tensors, read, torch_dtype, size)

        tok = task.tokenizer if task is not None else None
        writer.write(model, staging, meta, card, tok, weights=write_weights, dtype=torch_dtype)
        if builtin and model_facts.get("tokenizer"):
            tokenizer.save(model_facts["tokenizer"], staging, saved.data.seq_len)
        checked = safetensors_io.check_weights(staging, tensors, read, torch_dtype)
        diff = reload.outputs(
            ckpt, saved, model_facts, task, tensors, read, torch_dtype, staging, lm
        )
        target.replace(staging, out, force)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _reported(Exported(out, ckpt.path, diff, kind, chosen, checked))


def _reported(done: Exported) -> Exported:
    """Log the export `done` on one line and return it."""
    log.info(
        "exported %s to %s in %s (%d tensors read back equal%s)",
        done.checkpoint,
        done.folder,
        done.dtype,
        done.tensors_checked,
        ""
        if done.max_logit_diff is None
        else f"; largest output difference after reloading: {done.max_logit_diff:.3g}",
    )
    return done


def _opened(
    source: Path,
    out: Path,
    best: bool | str,
    step: int | None,
    force: bool,
    dtype: str | None,
    trust_code: bool,
    weights: str,
) -> tuple[checkpoint.Checkpoint, RunConfig, str]:
    """The checkpoint to export, its config and the dtype to write, once every check has passed:
    the checkpoint verifies and holds the weights asked for, `out` may be written, the config's
    code may be imported."""
    ckpt = origin.select(source, best, step)
    origin.check_weights(ckpt, weights)
    if (refused := target.refusal(out, force)) is not None:
        raise QgtrainError(refused)
    saved = origin.yaml_config(ckpt)
    require_trusted(saved, source, ckpt.path / layout.CONFIG, trust_code)
    return ckpt, saved, export_dtype(dtype or saved.export.dtype, origin.trained_precision(ckpt))


def _card_and_meta(
    ckpt: checkpoint.Checkpoint,
    saved: RunConfig,
    folder: Path,
    model: torch.nn.Module,
    model_facts: dict[str, Any],
    chosen: str,
    weights: str,
    kind: str,
) -> tuple[str, dict[str, Any]]:
    """The model card and qgtrain_model.json's contents: what the run did and how to load it; the
    task's own code is copied into `folder` first (bundle.py), and they name it there."""
    saved, copied = bundle.bundled(saved, folder)
    builtin = saved.task.factory == BUILTIN_LM
    lm = builtin and kind == "transformers"
    facts = {
        **origin.run_facts(
            ckpt,
            saved,
            (model_facts.get("tokenizer") or "none (the data came from a factory)")
            if builtin
            else None,
        ),
        "dtype": chosen,
        "weights": weights,
    }
    builder = (
        f"model.factory {saved.model.factory}"
        if builtin
        else f"the task function {saved.task.factory}"
    )
    published = writer.publishable(config_to_dict(saved))
    card = writer.model_card(
        saved.train.run_name,
        f"A `{type(model).__name__}`",
        writer.library_of(model),
        saved.task.factory,
        facts,
        published,
        LM_USAGE if lm else writer.usage(kind, model, builder),
        "text-generation" if lm else None,
    ) + bundle.card_note(copied)
    meta = {
        "task": saved.task.factory,
        "options": saved.task.options,
        "model_facts": model_facts,
        "run": facts,
        "config": published,
    }
    return card, meta


def _adapter_card(
    ckpt: checkpoint.Checkpoint, saved: RunConfig, kind: str, chosen: str, weights: str
) -> str:
    """The card of an adapter export (in place of peft's blank template) or of its merged model:
    the run's facts, the config, and how to load it; the base by its folder's name only, since its
    path names the user's home and cluster."""
    facts = {**origin.run_facts(ckpt, saved, None), "dtype": chosen, "weights": weights}
    base = Path(saved.model.pretrained).name if saved.model.pretrained else "train.seed"
    lora = f"LoRA adapters (rank {saved.model.lora_rank}) of the model `{base}`"
    merged = kind == "merged"
    return writer.model_card(
        saved.train.run_name,
        f"A model with {lora} merged in" if merged else lora,
        "transformers" if merged else "peft",
        saved.task.factory,
        facts,
        writer.publishable(config_to_dict(saved)),
        LM_USAGE if merged else ADAPTER_USAGE.format(base=base),
        "text-generation",
    )


def _export_adapter(
    ckpt: checkpoint.Checkpoint,
    saved: RunConfig,
    out: Path,
    merge: bool,
    force: bool,
    chosen: str,
    weights: str,
) -> Exported:
    merge = merge or saved.export.merge
    if saved.model.adapter == "none":
        raise QgtrainError(
            f"export --merge: {ckpt.path} trained no adapters (model.adapter: "
            "none); export it without --merge: that is the full model already"
        )
    staging = target.staging(out)
    try:
        kind, diff = adapter.write(
            ckpt, saved, staging, merge, safetensors_io.DTYPES[chosen], weights
        )
        (staging / "README.md").write_text(_adapter_card(ckpt, saved, kind, chosen, weights))
        target.replace(staging, out, force)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info(
        "exported %s to %s (%s); %s",
        ckpt.path,
        out,
        kind,
        "checked by names and shapes"
        if diff is None
        else f"largest output difference after reloading: {diff:.3g}",
    )
    return Exported(out, ckpt.path, diff, kind, "fp32" if not merge else chosen)


def require_trusted(
    saved: RunConfig, source: Path, config: Path, trust_code: bool, what: str = "export"
) -> None:
    """The code the config names is imported if built in, if the run is yours, or if trusted."""
    named = config_code(saved)
    if trust_code or all(n.builtin() for n in named):
        return
    why_not = not_yours(source, config)
    if why_not is not None:
        require(
            named,
            config,
            why_not=why_not,
            what=what,
            fix="--trust-code (trust_code=True in Python)",
        )


def export_dtype(setting: str, trained: str | None) -> str:
    """auto: bf16 for a run that trained in bf16 (its natural dtype: what it computed in), else
    fp32."""
    if setting not in ("auto", "bf16", "fp32"):
        raise QgtrainError(
            f"export: dtype {setting!r} is not allowed; choose one of auto, bf16, fp32"
        )
    return ("bf16" if trained == "bf16" else "fp32") if setting == "auto" else setting


def _set_generation_eos(model: torch.nn.Module, eos: int | None) -> None:
    generation = getattr(model, "generation_config", None)
    if eos is not None and generation is not None:
        generation.eos_token_id = eos
        generation.pad_token_id = eos
