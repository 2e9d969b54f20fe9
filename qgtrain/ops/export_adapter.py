"""`qgtrain export` of a LoRA run: a PEFT adapter folder, or with `merge` the full model with the
adapters merged in; either reloaded as its user loads it and compared with the run's own model.

The base is built as training built it (read from model.pretrained, or drawn from train.seed) and must
be the one the checkpoint names; the adapters are read from the checkpoint (either kind) into a
PeftModel around it, which writes the adapter folder in peft's own format. Adapters are written in fp32
(they are small; export.dtype applies to the merged model). The merge is peft's merge_and_unload on
the CPU: the process holds the base in fp32 once, and a second copy while the reloaded folder is checked.

A base built from a seed is refused without --merge: an adapter folder must name a base its user can
load, and writing that base beside it would be as large as the merged model, which loads alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..config import RunConfig
from ..data import tokenizer
from ..errors import CheckpointError, QgtrainError
from ..state import checkpoint
from ..state.weights import describe
from ..training.adapters import base_identity, lora_config
from . import export_stream, export_task

PREFIX = "base_model.model."  # what a PeftModel puts before the adapted model's names


def write(ckpt: checkpoint.Checkpoint, cfg: RunConfig, staging: Path, merge: bool,
          dtype: torch.dtype) -> tuple[str, float]:
    """Write the export into `staging`; returns its kind and the largest output difference found when
    it was reloaded."""
    saved = checkpoint.load_json(ckpt, "state.json").get("adapter") or {}
    if not cfg.model.pretrained and not merge:
        raise QgtrainError(f"export: {ckpt.path} trained LoRA adapters on a model built from "
                           f"train.seed, which no adapter folder can name as its base. HINT: export "
                           "the merged model with --merge")
    model, base_path = _adapted_base(ckpt, cfg, saved)
    facts = json.loads((ckpt.path / "model.json").read_text())
    run = export_task.token_batch(cfg.data.seq_len, int(facts.get("vocab_size", 257)))
    if merge:
        diff = _merged(model, staging, dtype, run)
    else:
        model.save_pretrained(staging)
        diff = _adapter_reloaded(model, base_path, staging, run)
    if facts.get("tokenizer"):
        tokenizer.save(facts["tokenizer"], staging, cfg.data.seq_len)
    return ("merged" if merge else "peft adapter"), diff


def _adapted_base(ckpt: checkpoint.Checkpoint, cfg: RunConfig, saved: dict[str, Any]) -> tuple[Any, str]:
    """The run's model: its base as training built it in a PeftModel, the checkpoint's adapters in it."""
    from peft import get_peft_model

    base = export_task.rebuild_task(cfg).model
    identity = base_identity(base, cfg)
    if identity != saved.get("base"):
        raise CheckpointError(f"export: {ckpt.path} was trained on {describe(saved.get('base'))}, but "
                              f"its config now builds {describe(identity)}; the adapters fit only "
                              "their own base")
    base_path = str(Path(cfg.model.pretrained).resolve()) if cfg.model.pretrained else ""
    model = get_peft_model(base, lora_config(cfg.model, saved["lora"]["targets"], base_path or None))
    inner = model.base_model.model
    wanted = {name: p for name, p in inner.named_parameters() if p.requires_grad}
    adapters = export_stream.checkpoint_reader(ckpt)(wanted)
    with torch.no_grad():
        for name, param in wanted.items():
            param.copy_(adapters[name])
    return model.eval(), base_path


def _adapter_reloaded(model: Any, base_path: str, folder: Path, run: Any) -> float:
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    return export_task.verify(model, PeftModel.from_pretrained(base, folder), run, folder)


def _merged(model: Any, folder: Path, dtype: torch.dtype, run: Any) -> float:
    """The adapters merged into their base, written and reloaded by transformers alone: its outputs
    against the unmerged model's (in fp32), or the merged model's as exported (in bf16)."""
    import transformers

    expected = export_task.outputs(model, run) if dtype == torch.float32 else None
    merged = model.merge_and_unload()
    merged.to(dtype).save_pretrained(folder)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if expected is None:
        return export_task.verify(merged.float(), reloaded, run, folder)
    return export_task.verify_against(expected, reloaded, run, folder)
