"""Exporting the model of a user's task: rebuilt by the task itself, saved the Hugging Face way, verified.

The task function is called again with the checkpoint's config (in a one-process group, on the CPU), so
the model comes back exactly as it was built for training, with its head and its tokenizer. A model
that is a transformers PreTrainedModel, or uses huggingface_hub's PyTorchModelHubMixin, is saved with
save_pretrained; anything else is refused with the way to make it exportable. The saved folder is then
reloaded as a user would and run on a batch of the task's own data: every output tensor must match.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import QgtrainError
from ..runtime import distributed, rng
from ..runtime.rendezvous import DistEnv
from ..state import checkpoint, sharded
from ..task import ReadyTask
from ..tasks.build import build_task

log = logging.getLogger("qgtrain")
MAX_OUTPUT_DIFF = 1e-4
SHARD_SIZE = "2GB"


def rebuild_task(ckpt: checkpoint.Checkpoint, cfg: Any) -> ReadyTask:
    """The task of the checkpoint's config, with the checkpoint's weights in its model (CPU, fp32, eval)."""
    with distributed.process_group(DistEnv(), torch.device("cpu"), 60.0, 600.0):
        rng.seed_everything(cfg.train.seed)
        task = build_task(cfg)
    sharded.load_model(ckpt, task.model)
    task.model.float().eval()
    return task


def save_task_model(task: ReadyTask, folder: Path, spec: str) -> None:
    model = task.model
    from huggingface_hub import PyTorchModelHubMixin
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        model.save_pretrained(folder, safe_serialization=True, max_shard_size=SHARD_SIZE)
    elif isinstance(model, PyTorchModelHubMixin):
        model.save_pretrained(folder)
    else:
        raise QgtrainError(
            f"export: the model of task {spec} is a {type(model).__name__}, neither a transformers PreTrainedModel "
            "nor a huggingface_hub PyTorchModelHubMixin, so it has no save_pretrained. HINT: add the mixin to its "
            "base classes (class MyModel(nn.Module, PyTorchModelHubMixin)) so its init arguments are saved with "
            "it, or build it as a transformers model; its weights are in the checkpoint's model.pt either way")
    if task.tokenizer is not None:
        task.tokenizer.save_pretrained(folder)


def verify_task_model(task: ReadyTask, folder: Path) -> float:
    """Reload `folder` with the model class's from_pretrained and compare outputs on a task batch."""
    split = task.val if task.val is not None and len(task.val) else task.train
    batch = task.collate([split[i] for i in range(min(4, len(split)))])
    reloaded = type(task.model).from_pretrained(folder).float().eval()
    expected, got = _outputs(task, task.model, batch), _outputs(task, reloaded, batch)
    if len(expected) != len(got) or not expected:
        raise QgtrainError(f"export: the reloaded model in {folder} returned {len(got)} tensor(s), the checkpoint's "
                           f"{len(expected)}; the export was not kept")
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(expected, got))
    if not diff <= MAX_OUTPUT_DIFF:
        raise QgtrainError(f"export: the reloaded model's outputs differ from the checkpoint's by {diff:.3g} (more "
                           f"than {MAX_OUTPUT_DIFF}); the export in {folder} was not kept")
    return diff


@torch.no_grad()
def _outputs(task: ReadyTask, model: nn.Module, batch: Any) -> list[torch.Tensor]:
    """Every tensor the model's forward returns while the task computes its loss on `batch`."""
    seen: list[torch.Tensor] = []
    hook = model.register_forward_hook(lambda module, args, out: seen.extend(_tensors(out)))
    try:
        task.loss(model, batch)
    finally:
        hook.remove()
    return seen


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def model_card(cfg: Any, model: nn.Module, table: str, config_yaml: str) -> str:
    name = type(model).__name__
    return f"""---
library_name: transformers
tags: [qgtrain]
---
# {cfg.train.run_name}

A `{name}` trained with qgtrain (task `{cfg.task.factory}`).

{table}

```python
from transformers import AutoConfig
import transformers
folder = "path/to/this/folder"
model = getattr(transformers, AutoConfig.from_pretrained(folder).architectures[0]).from_pretrained(folder)
```

## Resolved training config

```yaml
{config_yaml.rstrip()}
```
"""
