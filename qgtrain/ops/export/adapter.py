"""`qgtrain export` of a LoRA run: a PEFT adapter folder, or with `merge` the full model with the
adapters merged in; either reloaded as its user loads it and compared with the run's own model.

The base is built as training built it (read from model.pretrained, or drawn from train.seed) and
must be the one the checkpoint names; the adapters are read from the checkpoint (either kind) into a
PeftModel around it, which writes the adapter folder in peft's own format. Adapters are written in
fp32 (they are small; export.dtype applies to the merged model).

The merge of a pretrained folder with safetensors weights is streamed tensor by tensor, in the
memory of one tensor and the adapters (merging.py). A base drawn from train.seed, a task's own
model, or a folder of pytorch_model.bin is merged in memory by peft's merge_and_unload on the CPU,
holding the model in fp32 once and a second copy while the reloaded folder is checked: a built-in
model is small by construction (model.* sizes it), and torch.load reads a .bin whole anyway.

A base built from a seed is refused without --merge: an adapter folder must name a base its user can
load, and writing that base beside it would be as large as the merged model, which loads alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ...config import RunConfig
from ...data import tokenizer
from ...foundation.errors import CheckpointError, QgtrainError
from ...foundation.folder_code import remote_code
from ...foundation.task import BUILTIN_LM
from ...state import checkpoint, ema_files, layout
from ...state.weights import describe
from ...training.adapters import base_identity, lora_config
from . import merging, rebuild, safetensors_io

PREFIX = "base_model.model."  # what a PeftModel puts before the adapted model's names


def write(
    ckpt: checkpoint.Checkpoint,
    cfg: RunConfig,
    staging: Path,
    merge: bool,
    dtype: torch.dtype,
    weights: str = "model",
) -> tuple[str, float | None]:
    """Write the export into `staging`; returns its kind and the largest output difference found
    when it was reloaded (None: a merged model too large to run, checked by names and shapes).
    `weights`: the trained adapters (model) or their EMA (ema): the frozen base has none."""
    saved = checkpoint.load_json(ckpt, layout.STATE).get("adapter") or {}
    if not cfg.model.pretrained and not merge:
        raise QgtrainError(
            f"export: {ckpt.path} trained LoRA adapters on a model built from "
            f"train.seed, which no adapter folder can name as its base. HINT: export "
            "the merged model with --merge (or export.merge: true)"
        )
    facts = json.loads((ckpt.path / layout.MODEL_FACTS).read_text())
    run = rebuild.token_batch(cfg.data.seq_len, int(facts.get("vocab_size", 257)))
    base = Path(cfg.model.pretrained).resolve() if cfg.model.pretrained else None
    streamed = base is not None and cfg.task.factory == BUILTIN_LM and merging.streamable(base)
    if merge and streamed and base is not None:
        diff = _streamed(ckpt, cfg, saved, base, staging, dtype, run, weights)
    else:
        diff = _in_memory(ckpt, cfg, saved, staging, merge, dtype, run, weights)
    if facts.get("tokenizer"):
        tokenizer.save(facts["tokenizer"], staging, cfg.data.seq_len)
    return ("merged" if merge else "peft adapter"), diff


def _streamed(
    ckpt: checkpoint.Checkpoint,
    cfg: RunConfig,
    saved: dict[str, Any],
    base: Path,
    staging: Path,
    dtype: torch.dtype,
    run: Any,
    weights: str,
) -> float | None:
    """The merge tensor by tensor; the run's model is built whole only to take the outputs the
    reloaded folder must give, and freed before the folder is loaded."""

    def expected() -> list[torch.Tensor]:
        model = _adapted_base(ckpt, cfg, saved, weights)[0]
        if dtype == torch.float32:
            return rebuild.outputs(model, run)
        merging.untie_adapted(model)
        merged = model.merge_and_unload()
        with torch.no_grad():  # the weights as exported; buffers (rotary frequencies) as computed
            for param in merged.parameters():
                param.copy_(param.to(dtype))
        return rebuild.outputs(merged, run)

    _check_base(ckpt, cfg, saved, base_identity(torch.nn.Module(), cfg))  # a folder: its files
    lora = lora_config(cfg.model, saved["lora"]["targets"], str(base))
    adapters = _adapter_reader(ckpt, weights)
    return merging.write(base, adapters, lora, staging, dtype, run, expected)


def _in_memory(
    ckpt: checkpoint.Checkpoint,
    cfg: RunConfig,
    saved: dict[str, Any],
    staging: Path,
    merge: bool,
    dtype: torch.dtype,
    run: Any,
    weights: str,
) -> float:
    model, base_path = _adapted_base(ckpt, cfg, saved, weights)
    if merge:
        diff = _merged(model, staging, dtype, run)
    else:
        model.save_pretrained(staging)
        diff = _adapter_reloaded(model, base_path, staging, run)
    return diff


def trained_model(ckpt: checkpoint.Checkpoint, cfg: RunConfig, weights: str) -> Any:
    """The run's model as the loop evaluated it (`qgtrain eval`): the base in a PeftModel holding
    the checkpoint's adapters, or their EMA, unmerged."""
    saved = checkpoint.load_json(ckpt, layout.STATE).get("adapter") or {}
    return _adapted_base(ckpt, cfg, saved, weights)[0]


def _adapted_base(
    ckpt: checkpoint.Checkpoint, cfg: RunConfig, saved: dict[str, Any], weights: str
) -> tuple[Any, str]:
    """The run's model: its base as training built it, in a PeftModel holding the checkpoint's
    adapters (or their EMA)."""
    from peft import get_peft_model

    base = rebuild.rebuild_task(cfg, checkpoint=ckpt.path).model
    _check_base(ckpt, cfg, saved, base_identity(base, cfg))
    base_path = str(Path(cfg.model.pretrained).resolve()) if cfg.model.pretrained else ""
    model = get_peft_model(
        base, lora_config(cfg.model, saved["lora"]["targets"], base_path or None)
    )
    inner = model.base_model.model
    wanted = {name: p for name, p in inner.named_parameters() if p.requires_grad}
    adapters = _adapter_reader(ckpt, weights)(wanted)
    with torch.no_grad():
        for name, param in wanted.items():
            param.copy_(adapters[name])
    return model.eval(), base_path


def _adapter_reader(ckpt: checkpoint.Checkpoint, weights: str) -> safetensors_io.Reader:
    """The adapters as trained, or their EMA: saved under the same names, since only the adapters
    are trained and so only they are averaged."""
    return ema_files.reader(ckpt) if weights == "ema" else safetensors_io.checkpoint_reader(ckpt)


def _check_base(
    ckpt: checkpoint.Checkpoint, cfg: RunConfig, saved: dict[str, Any], identity: dict[str, Any]
) -> None:
    if identity != saved.get("base"):
        raise CheckpointError(
            f"{ckpt.path} was trained on {describe(saved.get('base'))}, "
            f"but its config now builds {describe(identity)}; the adapters fit "
            "only their own base"
        )


def _adapter_reloaded(model: Any, base_path: str, folder: Path, run: Any) -> float:
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(
        base_path, dtype=torch.float32, trust_remote_code=remote_code(base_path, "model.pretrained")
    )
    # peft runs no code an adapter folder names (its config class comes from a fixed table), and
    # ignores trust_remote_code; given for the rule that every from_pretrained is told
    adapters = PeftModel.from_pretrained(base, folder, trust_remote_code=False)
    return rebuild.verify(model, adapters, run, folder)


def _merged(model: Any, folder: Path, dtype: torch.dtype, run: Any) -> float:
    """The adapters merged into their base, written and reloaded by transformers alone: its outputs
    against the unmerged model's (in fp32), or the merged model's as exported (in bf16)."""
    import transformers

    expected = rebuild.outputs(model, run) if dtype == torch.float32 else None
    merging.untie_adapted(model)  # a delta merged into a shared tensor changes its partner
    merged = model.merge_and_unload()
    merged.to(dtype).save_pretrained(folder)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, trust_remote_code=remote_code(folder, "export")
    )
    if expected is None:
        return rebuild.verify(merged.float(), reloaded, run, folder)
    return rebuild.verify_against(expected, reloaded, run, folder)
