"""Where an export comes from: the checkpoint it reads (the latest, best or step N of a run
directory that verifies, or one checkpoint folder), and what that checkpoint says about its run:
its config, the task's facts, the precision it trained in, and the facts a model card shows.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ...config import RunConfig
from ...config.load import config_from_dict
from ...foundation.errors import CheckpointError, QgtrainError
from ...runs.rundir import RunDir
from ...state import checkpoint, ema_files, layout, sharded
from ...training.metrics import read_metrics

log = logging.getLogger("qgtrain")


def select(source: Path, best: bool | str, step: int | None) -> checkpoint.Checkpoint:
    """The checkpoint to export: the first of the candidates that verifies, newest first."""
    candidates = _candidates(source, best, step)
    for ckpt in candidates:
        problem = checkpoint.verify(ckpt)
        if problem is None:
            weights = (ckpt.path / layout.MODEL).exists() or sharded.is_sharded_checkpoint(ckpt)
            if not weights or not (ckpt.path / layout.CONFIG).exists():
                raise CheckpointError(
                    f"export: {ckpt.path} has no model weights or config to export"
                )
            return ckpt
        if len(candidates) == 1:
            raise CheckpointError(f"export: {problem}")
        log.warning("skipping checkpoint %s: %s", ckpt.path.name, problem)
    raise CheckpointError(f"export: no checkpoint in {source} verifies (see the warnings above)")


def _candidates(source: Path, best: bool | str, step: int | None) -> list[checkpoint.Checkpoint]:
    if not source.exists():
        raise QgtrainError(
            f"export: {source} does not exist; give a run directory or a checkpoint folder"
        )
    direct = checkpoint.read_manifest(source)
    if direct is not None:
        if best or step is not None:
            raise QgtrainError(
                f"export: {source} is one checkpoint; --best and --step choose within a run "
                "directory"
            )
        return [direct]
    root = RunDir(source).checkpoints
    committed = checkpoint.list_committed(root)
    if not committed:
        raise QgtrainError(
            f"export: {source} holds no committed checkpoint (looked in {root} and for a "
            f"{checkpoint.MANIFEST} in {source})"
        )
    if step is not None:
        committed = [c for c in committed if c.step == step]
        if not committed:
            steps = ", ".join(str(c.step) for c in checkpoint.list_committed(root))
            raise QgtrainError(
                f"export: no checkpoint at step {step} in {root}; there are: {steps}"
            )
    elif isinstance(best, str) and best:
        committed = [_best_by(committed, best, root)]
    elif best:
        scored = [c for c in committed if c.score is not None]
        if not scored:
            raise QgtrainError(f"export --best: no checkpoint in {root} records a validation score")
        committed = [min(scored, key=lambda c: (c.score, -c.step))]
    return list(reversed(committed))


def _best_by(
    committed: list[checkpoint.Checkpoint], metric: str, root: Path
) -> checkpoint.Checkpoint:
    """The best checkpoint by `metric`, the latest among equals: lowest for a loss or perplexity,
    highest for anything else (accuracy, exact match)."""
    scored = [c for c in committed if c.metric(metric) is not None]
    if not scored:
        raise QgtrainError(
            f"export --best {metric}: no checkpoint in {root} records it (checkpoints record "
            "the figures of the validation they ended: val_loss, val_<name>, eval_<task>_<metric>)"
        )
    sign = 1.0 if metric.endswith(("loss", "ppl")) else -1.0
    return min(scored, key=lambda c: (sign * (c.metric(metric) or 0.0), -c.step))


def check_weights(ckpt: checkpoint.Checkpoint, weights: str) -> None:
    if weights not in ("model", "ema"):
        raise QgtrainError(f"export: weights {weights!r} is not allowed; choose model or ema")
    if weights == "ema" and not ema_files.saved(ckpt):
        raise QgtrainError(
            f"export --weights ema: {ckpt.path} holds no EMA of the weights (its "
            "run trained with train.ema_decay 0); export --weights model, or train "
            "with train.ema_decay above 0, e.g. 0.999"
        )


def yaml_config(ckpt: checkpoint.Checkpoint) -> RunConfig:
    import yaml

    saved = ckpt.path / layout.CONFIG
    return config_from_dict(yaml.safe_load(saved.read_text()), str(saved))


def model_facts(ckpt: checkpoint.Checkpoint) -> dict[str, Any]:
    """The task's facts (model.json); none where the checkpoint holds no such file."""
    path = ckpt.path / layout.MODEL_FACTS
    return json.loads(path.read_text()) if path.exists() else {}


def trained_precision(ckpt: checkpoint.Checkpoint) -> str | None:
    return checkpoint.load_json(ckpt, layout.STATE).get("precision")


def run_facts(
    ckpt: checkpoint.Checkpoint, cfg: RunConfig, tokenizer_name: str | None
) -> dict[str, Any]:
    """What training did, from the checkpoint and the run's metrics: in the model card and
    qgtrain_model.json (the checkpoint by its folder's name: its full path names the user's home and
    cluster)."""
    state = checkpoint.load_json(ckpt, layout.STATE)
    trainer, versions = state["trainer"], state.get("versions", {})
    metrics = RunDir(ckpt.path.parent.parent).metrics
    losses = (
        [r["loss"] for r in read_metrics(metrics) if "loss" in r and r["step"] <= ckpt.step]
        if metrics.exists()
        else []
    )
    return {
        "qgtrain": versions.get("qgtrain", "?"),
        "torch": versions.get("torch", "?"),
        "checkpoint": ckpt.path.name,
        "step": ckpt.step,
        "epochs": trainer["epoch"] + 1,
        "tokens_seen": trainer.get("tokens_seen"),
        "train_loss": losses[-1] if losses else None,
        "val": trainer.get("val_metrics", {"loss": trainer.get("val_loss")}),
        "test": trainer.get("test_metrics", {"loss": trainer.get("test_loss")}),
        "precision": state.get("precision", "?"),
        "ranks": state.get("world_size", "?"),
        "parallel": cfg.train.parallel,
        "tokenizer": tokenizer_name,
    }
