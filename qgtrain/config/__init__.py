"""The run configuration: one frozen dataclass per section of config.yaml, and the rules between
fields, one module per section.

Every field carries its own documentation and bounds in `metadata`, so the loader (config/load.py)
can validate a file and explain a mistake without a second copy of the schema, and config.yaml's
comments are held equal to it (tests/test_config.py). World size and ranks are deliberately
absent: the scheduler supplies them (rendezvous.py).
"""

from .checkpoint import CheckpointConfig
from .data import DataConfig
from .early_stopping import EarlyStoppingConfig
from .eval import EvalConfig
from .export import ExportConfig
from .fields import MAX_TIMEOUT_S, setting
from .logging import LoggingConfig
from .model import ModelConfig
from .optim import OptimConfig
from .run import SECTIONS, RunConfig, check_rules
from .slurm import SlurmConfig
from .task import TaskConfig
from .train import TrainConfig

__all__ = [
    "MAX_TIMEOUT_S",
    "SECTIONS",
    "CheckpointConfig",
    "DataConfig",
    "EarlyStoppingConfig",
    "EvalConfig",
    "ExportConfig",
    "LoggingConfig",
    "ModelConfig",
    "OptimConfig",
    "RunConfig",
    "SlurmConfig",
    "TaskConfig",
    "TrainConfig",
    "check_rules",
    "setting",
]
