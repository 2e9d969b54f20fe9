"""qgtrain: PyTorch DDP training on Slurm clusters that survives time limits and preemption.

`import qgtrain` stays light (no torch, no submitit); `qgtrain.submit` loads its launcher when first used.
"""

from typing import Any

from .version import __version__

__all__ = ["__version__", "submit"]


def __getattr__(name: str) -> Any:
    if name == "submit":
        from .launch.submitit_launcher import submit

        return submit
    raise AttributeError(f"module 'qgtrain' has no attribute {name!r}")
