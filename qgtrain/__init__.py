"""qgtrain: PyTorch DDP training on Slurm clusters that survives time limits and preemption.

`import qgtrain` stays light (no torch, no submitit); `qgtrain.submit` loads its launcher when first used.
"""

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "submit":
        from .submitit_launcher import submit

        return submit
    raise AttributeError(f"module 'qgtrain' has no attribute {name!r}")
