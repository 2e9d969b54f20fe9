"""qgtrain: PyTorch DDP training on Slurm clusters that survives time limits and preemption."""

__version__ = "0.1.0"
