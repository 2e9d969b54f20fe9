"""`qgtrain export`: a checkpoint as a Hugging Face model folder that plain transformers loads.

Offline and on the CPU (no GPU, no process group): the checkpoint's model is rebuilt from the config it
saved, written with save_pretrained (safetensors, sharded past a size), with its tokenizer and a model card,
then reloaded with AutoModelForCausalLM and compared logit by logit with the checkpoint before the folder
is moved into place. A user's task is exported through its own model class (export_task.py).
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

from ..config import RunConfig
from ..configload import config_from_dict, dump_yaml
from ..data import tokenizer
from ..errors import CheckpointError, QgtrainError
from ..state import checkpoint, sharded
from ..state.rundir import RunDir
from ..task import BUILTIN_LM
from ..tasks.models import build_model
from ..training.metrics import read_metrics
from . import export_task

log = logging.getLogger("qgtrain")
MAX_LOGIT_DIFF = 1e-4
SHARD_SIZE = "2GB"


@dataclass(frozen=True)
class Exported:
    folder: Path
    checkpoint: Path
    max_logit_diff: float


def export_run(source: Path, out: Path, *, best: bool = False, step: int | None = None,
               force: bool = False) -> Exported:
    """Export the latest (or best, or step N) checkpoint of a run directory, or one checkpoint folder."""
    ckpt = _select(Path(source), best, step)
    import transformers

    transformers.utils.logging.disable_progress_bar()  # a bar per weight load is noise in a CLI
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise QgtrainError(f"export: {out} is not empty; choose another --out or pass --force to replace it")
    saved = yaml_config(ckpt)
    builtin = saved.task.factory == BUILTIN_LM
    model_facts = json.loads((ckpt.path / "model.json").read_text()) if (ckpt.path / "model.json").exists() else {}
    task = None if builtin else export_task.rebuild_task(ckpt, saved)
    model = _rebuild(ckpt, saved, model_facts) if task is None else task.model
    staging = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        if task is None:
            _save_model(model, staging, saved, model_facts)
            if model_facts.get("tokenizer"):
                tokenizer.save(model_facts["tokenizer"], staging, saved.data.seq_len)
            (staging / "README.md").write_text(_model_card(ckpt, saved, model_facts))
            diff = _verify(model, staging, saved.data.seq_len, model_facts)
        else:
            export_task.save_task_model(task, staging, saved.task.factory)
            (staging / "README.md").write_text(export_task.model_card(
                saved, model, facts_table(ckpt, None), dump_yaml(saved)))
            diff = export_task.verify_task_model(task, staging)
        _replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log.info("exported %s to %s (largest logit difference after reloading: %.3g)", ckpt.path, out, diff)
    return Exported(out, ckpt.path, diff)


def yaml_config(ckpt: checkpoint.Checkpoint) -> RunConfig:
    import yaml

    return config_from_dict(yaml.safe_load((ckpt.path / "config.yaml").read_text()), str(ckpt.path / "config.yaml"))


def _select(source: Path, best: bool, step: int | None) -> checkpoint.Checkpoint:
    """The checkpoint to export: the first of the candidates that verifies, newest first."""
    candidates = _candidates(source, best, step)
    for ckpt in candidates:
        problem = checkpoint.verify(ckpt)
        if problem is None:
            weights = (ckpt.path / "model.pt").exists() or sharded.is_sharded_checkpoint(ckpt)
            if not weights or not (ckpt.path / "config.yaml").exists():
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


def _rebuild(ckpt: checkpoint.Checkpoint, cfg: Any, facts: dict[str, Any]) -> torch.nn.Module:
    """The checkpoint's model on the CPU in fp32: from its saved transformers config, or its factory."""
    if (ckpt.path / "hf_config.json").exists():
        import transformers

        hf = json.loads((ckpt.path / "hf_config.json").read_text())
        config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        model = build_model(cfg.model, facts.get("vocab_size", 257), cfg.data.seq_len, facts.get("eos_id"))
    sharded.load_model(ckpt, model)
    return model.float().eval()


def _save_model(model: torch.nn.Module, folder: Path, cfg: Any, facts: dict[str, Any]) -> None:
    from huggingface_hub import PyTorchModelHubMixin
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        eos = facts.get("eos_id")
        if eos is not None and model.generation_config is not None:
            model.generation_config.eos_token_id = eos
            model.generation_config.pad_token_id = eos
        model.save_pretrained(folder, safe_serialization=True, max_shard_size=SHARD_SIZE)
        return
    if isinstance(model, PyTorchModelHubMixin):
        model.save_pretrained(folder)
        return
    raise QgtrainError(
        f"export: {type(model).__name__} (from model.factory {cfg.model.factory}) is neither a transformers "
        "PreTrainedModel nor a huggingface_hub PyTorchModelHubMixin, so it has no save_pretrained. HINT: "
        "build it from a transformers config, or add PyTorchModelHubMixin to its base classes "
        "(class MyModel(nn.Module, PyTorchModelHubMixin)) so its init arguments are saved with it")


def _verify(model: torch.nn.Module, folder: Path, seq_len: int, facts: dict[str, Any]) -> float:
    """Reload the folder as a user would and compare logits with the checkpoint's model."""
    tokens = torch.arange(min(seq_len, 64)).unsqueeze(0) % int(facts.get("vocab_size", 257))
    with torch.no_grad():
        expected = _logits(model, tokens)
        if (folder / "config.json").exists() and hasattr(model, "generation_config"):
            import transformers

            reloaded = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        else:
            hub_class: Any = type(model)  # a PyTorchModelHubMixin, checked when it was saved
            reloaded = hub_class.from_pretrained(folder).eval()
        diff = float((_logits(reloaded, tokens) - expected).abs().max())
    if not diff <= MAX_LOGIT_DIFF:
        raise QgtrainError(f"export: the reloaded model's logits differ from the checkpoint's by {diff:.3g} "
                           f"(more than {MAX_LOGIT_DIFF}); the export in {folder} was not kept")
    return diff


def _logits(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=tokens)
    return (out.logits if hasattr(out, "logits") else out).float()


def _replace(staging: Path, out: Path) -> None:
    """Move the verified export into place; a replaced folder goes only once the new one is there."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.rename(out, old)
    os.rename(staging, out)
    shutil.rmtree(old, ignore_errors=True)


def facts_table(ckpt: checkpoint.Checkpoint, tokenizer_name: str | None) -> str:
    """What a reader of the model card wants to know about the training, as a Markdown table."""
    state = checkpoint.load_json(ckpt, "state.json")
    trainer, versions = state["trainer"], state.get("versions", {})
    train_loss = None
    metrics = RunDir(ckpt.path.parent.parent).metrics
    if metrics.exists():
        losses = [r["loss"] for r in read_metrics(metrics) if "loss" in r and r["step"] <= ckpt.step]
        train_loss = losses[-1] if losses else None

    def fmt(value: Any) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    val = trainer.get("val_metrics", {"loss": trainer.get("val_loss")})
    test = trainer.get("test_metrics", {"loss": trainer.get("test_loss")})
    rows = [("qgtrain", versions.get("qgtrain", "?")), ("torch", versions.get("torch", "?")),
            ("checkpoint", f"`{ckpt.path}`"), ("steps", ckpt.step), ("epochs begun", trainer["epoch"] + 1),
            ("final train loss", fmt(train_loss)),
            *((f"final validation {name}", fmt(value)) for name, value in val.items()),
            *((f"test {name}", fmt(value)) for name, value in test.items()),
            ("precision", state.get("precision", "?")), ("ranks", state.get("world_size", "?"))]
    if trainer.get("tokens_seen"):
        rows.insert(5, ("tokens seen", f"{trainer['tokens_seen']:,}"))
    if tokenizer_name is not None:
        rows.append(("tokenizer", tokenizer_name))
    return "| fact | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)


def _model_card(ckpt: checkpoint.Checkpoint, cfg: Any, facts: dict[str, Any]) -> str:
    table = facts_table(ckpt, facts.get("tokenizer") or "none (the data came from a factory)")
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags: [qgtrain]
---
# {cfg.train.run_name}

A causal language model trained with qgtrain.

{table}

```python
from transformers import pipeline
generate = pipeline("text-generation", model="path/to/this/folder")
print(generate("def main(", max_new_tokens=40)[0]["generated_text"])
```

## Resolved training config

```yaml
{dump_yaml(cfg).rstrip()}
```
"""
