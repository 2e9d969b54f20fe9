"""A run's whole configuration: one section per part of config.yaml, and the rules applied once
every field has passed its own bounds (config/load.py), each section's beside it."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields

from ..foundation.errors import ConfigError
from .checkpoint import CheckpointConfig, checkpoint_rules
from .data import DataConfig, data_rules
from .early_stopping import EarlyStoppingConfig, early_stopping_rules
from .eval import EvalConfig, eval_rules
from .export import ExportConfig, export_rules
from .logging import LoggingConfig, logging_rules
from .model import ModelConfig, model_rules
from .optim import OptimConfig, optim_rules
from .slurm import SlurmConfig, slurm_rules
from .task import TaskConfig, task_rules
from .train import TrainConfig, spike_rules, training_rules


@dataclass(frozen=True)
class RunConfig:
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    early_stopping: EarlyStoppingConfig = field(default_factory=EarlyStoppingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


SECTIONS: dict[str, type] = {
    f.name: typing.get_type_hints(RunConfig)[f.name] for f in fields(RunConfig)
}
RULES = (
    task_rules,
    model_rules,
    data_rules,
    optim_rules,
    training_rules,
    spike_rules,
    early_stopping_rules,
    eval_rules,
    checkpoint_rules,
    slurm_rules,
    export_rules,
    logging_rules,
)


def check_rules(cfg: RunConfig, source: str) -> None:
    """Rules that involve more than one field; `source` names where the values came from."""
    for rules in RULES:
        problem = rules(cfg)
        if problem is not None:
            key, text = problem
            raise ConfigError(f"{source}: {key}: {text}")
