"""Reloading an export as its user would: whole, for a small model; by names and shapes, for a large
one.

Every export's tensors are read back and compared with the checkpoint's one at a time
(safetensors_io.py). A model up to OUTPUTS_CHECKED_UP_TO is also rebuilt with the checkpoint's
weights (in the export dtype), the folder loaded the way its user loads it (transformers'
from_pretrained, qgtrain.load_model), and both run on a batch of the task's data: their outputs
must agree, which also catches a model whose eval forward is random. A larger model is never held
whole: its exported config is built without weights and must name and shape exactly the tensors
written.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from ...foundation.errors import QgtrainError
from ...foundation.folder_code import remote_code
from ...foundation.task import ReadyTask
from ...state.checkpoint import Checkpoint
from ...tasks.empty_weights import building_empty
from ..load_model import exported_model
from . import rebuild, safetensors_io

OUTPUTS_CHECKED_UP_TO = 64 << 20  # bytes of the model in fp32


def outputs(
    ckpt: Checkpoint,
    cfg: Any,
    facts: dict[str, Any],
    task: ReadyTask | None,
    weights: dict[str, torch.Tensor],
    read: safetensors_io.Reader,
    dtype: torch.dtype,
    folder: Path,
    lm: bool,
) -> float | None:
    """The largest output difference of the reloaded folder, or None for a model checked by names
    only."""
    if sum(4 * math.prod(t.shape) for t in weights.values()) > OUTPUTS_CHECKED_UP_TO:
        if lm:
            check_names(folder, weights, dtype)
        return None
    import transformers

    model = (
        rebuild.rebuild_task(cfg).model
        if task is not None
        else rebuild.rebuild_lm(ckpt.path, cfg, facts, as_exported=True)
    )
    as_exported = {
        name: safetensors_io.converted(t, dtype).to(t.dtype) for name, t in read(weights).items()
    }
    # tied partners filled through the tensor written
    model.load_state_dict(as_exported, strict=False)
    model.float().eval()
    reloaded = (
        transformers.AutoModelForCausalLM.from_pretrained(
            folder, dtype=torch.float32, trust_remote_code=remote_code(folder, "export")
        )
        if lm
        else exported_model(folder, trust_code=True)
    )  # export.py decided about the same config's code, and the export's --trust-code about
    # the code a model folder names (folder_code.py)
    run = (
        rebuild.task_batch(task)
        if task is not None
        else rebuild.token_batch(cfg.data.seq_len, int(facts.get("vocab_size", 257)))
    )
    return rebuild.verify(model, reloaded, run, folder)


def check_names(folder: Path, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    import transformers

    code = remote_code(folder, "export")
    config = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=code)
    with building_empty(meta=True):
        built = safetensors_io.tensors_to_write(
            transformers.AutoModelForCausalLM.from_config(config, trust_remote_code=code)
        )
    differ = sorted(set(built) ^ set(weights))
    differ += [n for n in built if n in weights and built[n].shape != weights[n].shape]
    if differ or config.dtype != dtype:
        what = ", ".join(differ[:5]) or f"dtype {config.dtype}"
        raise QgtrainError(
            f"export: the config.json written to {folder} builds a model that differs from the "
            f"checkpoint's ({what}); the export was not kept"
        )
