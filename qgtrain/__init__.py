"""qgtrain: PyTorch training on Slurm clusters that survives time limits and preemption.

`import qgtrain` stays light (no torch, no submitit): `Task` and `RunConfig` are plain dataclasses,
and `qgtrain.train` and `qgtrain.submit` load what they need when first called.
"""

from typing import Any

from .config import RunConfig
from .foundation.result import TrainResult
from .foundation.task import Task
from .foundation.version import __version__

__all__ = [
    "RunConfig",
    "Task",
    "TrainResult",
    "__version__",
    "load_config",
    "load_model",
    "submit",
    "submit_sweep",
    "train",
]


def __dir__() -> list[str]:
    """What `__all__` names, the lazily loaded functions included, beside the module's own names."""
    return sorted(set(globals()) | set(__all__))


def __getattr__(name: str) -> Any:
    if name == "submit":
        from .launch.submitit_launcher import submit

        return submit
    if name == "submit_sweep":
        from .launch.submitit_launcher import submit_sweep

        return submit_sweep
    if name == "train":
        from .interface.api import train

        return train
    if name == "load_model":
        from .ops.load_model import load_model

        return load_model
    if name == "load_config":
        from .config.load import load_config

        return load_config
    raise AttributeError(f"module 'qgtrain' has no attribute {name!r}")
