"""The logging section: where runs live, what is logged and to which trackers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..foundation.redact import mask_text, uri_credentials
from .fields import Problem, setting

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass(frozen=True)
class LoggingConfig:
    runs_dir: str = setting("runs", "parent of every run directory")
    level: Literal["DEBUG", "INFO", "WARNING"] = setting("INFO", "console and log-file level")
    tensorboard: bool = setting(True, "write TensorBoard events to <run dir>/tb (rank 0)")
    trackers: tuple[str, ...] = setting(
        (),
        "experiment trackers besides TensorBoard: wandb, mlflow (optional extras); one "
        "tracker run per qgtrain run, across requeues",
    )
    wandb_project: str = setting("qgtrain", "the W&B project")
    wandb_mode: Literal["offline", "online"] = setting(
        "offline",
        "offline: write locally, upload later with `wandb sync` (compute nodes often "
        "have no network)",
    )
    mlflow_uri: str = setting(
        "",
        "MLflow tracking URI ('' = a file store in <runs_dir>/mlruns), without credentials: "
        "set MLFLOW_TRACKING_USERNAME/PASSWORD or _TOKEN in the environment",
    )
    mlflow_experiment: str = setting("qgtrain", "the MLflow experiment")
    progress: Literal["auto", "bar", "lines"] = setting(
        "auto", "auto: a progress bar on a terminal, plain lines in Slurm output files"
    )
    memory_warn_gb: float = setting(
        0.0, "warn when a rank's CPU RSS or GPU peak passes this (0 = off)", min=0.0
    )
    shared: bool = setting(
        False,
        "false: a new run directory and data cache entries are private to you (mode 0700); "
        "true: your group may read them (0750), never write them",
    )


def logging_rules(cfg: RunConfig) -> Problem:
    for tracker in cfg.logging.trackers:
        if tracker not in ("tensorboard", "wandb", "mlflow"):
            return "logging.trackers", (
                f"{tracker!r} is not a tracker qgtrain knows; choose from tensorboard, "
                "wandb, mlflow"
            )
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
        "MLFLOW_TRACKING_TOKEN) in the job's environment"
    )
