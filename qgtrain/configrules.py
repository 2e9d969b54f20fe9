"""The rules between fields of a run's config, which config.check_rules applies once every field has
passed its own bounds (configload.py): each names the first key it finds wrong, or None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .durations import duration_s
from .redact import mask_text, uri_credentials

if TYPE_CHECKING:  # config.py imports these rules; they only read its dataclasses
    from .config import RunConfig

Problem = tuple[str, str] | None  # (the key, what is wrong with it and what to do)


def model_and_data_rules(cfg: RunConfig) -> Problem:
    if cfg.model.pretrained and cfg.model.factory:
        return "model.factory", "set either model.pretrained or model.factory, not both"
    if not cfg.model.pretrained and not cfg.model.factory and cfg.model.hidden % cfg.model.heads:
        return "model.hidden", (
            f"{cfg.model.hidden} is not divisible by model.heads={cfg.model.heads}")
    if cfg.model.adapter == "lora" and cfg.model.lora_alpha <= 0:
        return "model.lora_alpha", f"{cfg.model.lora_alpha} must be above 0 (e.g. 2 x model.lora_rank)"
    if cfg.data.name == "factory" and not cfg.data.factory:
        return "data.factory", "data.name is 'factory' but no 'package.module:function' is given"
    for key, value in (("task.factory", cfg.task.factory), ("model.factory", cfg.model.factory),
                       ("data.factory", cfg.data.factory)):
        if value and (value.count(":") != 1 or not all(value.split(":"))):
            return key, (f"'{value}' is not of the form 'package.module:function' or "
                         "'path/to/file.py:function'")
    if cfg.data.name == "files" and not cfg.data.files:
        return "data.files", ("data.name is 'files' but no files are named; give globs, files or "
                              "folders, e.g. ['/shared/corpus/*.jsonl.gz']")
    if cfg.data.val_fraction + cfg.data.test_fraction >= 0.9:
        return "data.test_fraction", (
            "data.val_fraction + data.test_fraction must leave most text for training")
    return None


def training_rules(cfg: RunConfig) -> Problem:
    train = cfg.train
    if cfg.optim.min_lr > cfg.optim.lr:
        return "optim.min_lr", f"{cfg.optim.min_lr} is above optim.lr={cfg.optim.lr}"
    if cfg.checkpoint.keep_last < 2:
        return "checkpoint.keep_last", (
            f"{cfg.checkpoint.keep_last} is below 2: the newest checkpoint may be half-written "
            "when a job dies, so the one before it must survive rotation")
    if train.parallel != "ddp" and train.precision == "fp16":
        return "train.precision", (
            "fp16 needs loss scaling, which qgtrain does not do on sharded gradients; use "
            f"bf16 with train.parallel: {train.parallel}")
    if train.parallel != "ddp" and cfg.model.compile:
        return "model.compile", (
            f"torch.compile with train.parallel: {train.parallel} is not supported yet; use "
            "ddp to compile, or turn model.compile off")
    if train.shard_group_size and train.parallel != "hsdp":
        return "train.shard_group_size", (
            f"applies to train.parallel: hsdp, not {train.parallel}; set it to 0")
    if train.precision == "fp16" and train.device == "cpu":
        return "train.precision", "fp16 needs a GPU; use bf16 or fp32 on CPU"
    name = train.run_name
    if not name.strip() or name != name.strip() or "/" in name or name in (".", "..") or \
            any(ord(c) < 32 for c in name):
        return "train.run_name", (
            f"{name!r} must be a plain directory name: not empty, no '/', no leading or "
            "trailing spaces, no control characters")
    if train.max_time and duration_s(train.max_time) is None:
        return "train.max_time", (
            f"{train.max_time!r} is not a duration; use e.g. 45m, 3h30m, 1d2h, 90s, or "
            "Slurm's HH:MM:SS or D-HH:MM:SS")
    if not 0.0 <= train.ema_decay < 1.0:
        return "train.ema_decay", (
            f"{train.ema_decay} is outside [0, 1): 0 turns the EMA of the weights off, a value "
            "below 1 such as 0.999 keeps it")
    if train.eval_ema and not train.ema_decay:
        return "train.eval_ema", "needs an EMA of the weights: set train.ema_decay, e.g. 0.999"
    return None


def reporting_rules(cfg: RunConfig) -> Problem:
    if not cfg.early_stopping.metric.startswith("val_"):
        return "early_stopping.metric", (
            f"'{cfg.early_stopping.metric}' is not a validation metric; use val_loss "
            "or val_<name> for a metric your task reports")
    for tracker in cfg.logging.trackers:
        if tracker not in ("tensorboard", "wandb", "mlflow"):
            return "logging.trackers", (
                f"{tracker!r} is not a tracker qgtrain knows; choose from tensorboard, "
                "wandb, mlflow")
    if cfg.early_stopping.patience and not cfg.train.eval_every:
        return "early_stopping.patience", (
            "early stopping needs validations: set train.eval_every > 0")
    return _tracker_uri_rule(cfg.logging.mlflow_uri)


def _tracker_uri_rule(uri: str) -> Problem:
    """A credential in the config would be copied into config.yaml of the run, of every checkpoint,
    of slurm/ and of sweep tasks, and into the tracker's own params; MLflow reads its own variables
    instead."""
    found = uri_credentials(uri) if uri else None
    if found is None:
        return None
    return "logging.mlflow_uri", (
        f"{mask_text(uri)!r} holds {found}, which the run's files would keep; give the URI without "
        "it and set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or "
        "MLFLOW_TRACKING_TOKEN) in the job's environment")


def spike_rules(cfg: RunConfig) -> Problem:
    train = cfg.train
    if 0 < train.spike_factor <= 1:
        return "train.spike_factor", (
            f"{train.spike_factor} would call a loss at or below the recent median a spike; use 0 "
            "(off) or a factor above 1, e.g. 3")
    for step in train.skip_steps:
        if not 1 <= step <= train.max_steps:
            return "train.skip_steps", (
                f"step {step} is not a step of this run; list steps from 1 to train.max_steps="
                f"{train.max_steps}")
    if (train.spike_factor or train.skip_steps) and train.precision == "fp16":
        key = "train.spike_factor" if train.spike_factor else "train.skip_steps"
        return key, ("fp16's loss scaler decides itself which updates to skip and takes no other "
                     "flag; use train.precision: bf16 or fp32 to skip steps")
    return _rollback_rule(cfg)


def _rollback_rule(cfg: RunConfig) -> Problem:
    if cfg.train.spike_action != "rollback":
        return None
    if not cfg.train.spike_factor:
        return "train.spike_action", ("rollback acts on loss spikes, which train.spike_factor: 0 "
                                      "does not look for; set train.spike_factor above 1, e.g. 3, "
                                      "or use skip")
    if not cfg.checkpoint.every_steps and not cfg.checkpoint.every_minutes:
        return "train.spike_action", ("rollback goes back to the latest checkpoint, and "
                                      "checkpoint.every_steps and checkpoint.every_minutes are "
                                      "both 0 (none is written before the end); set "
                                      "checkpoint.every_steps, e.g. 10, or use skip")
    return None
