"""The checkpoint section: how often, how many kept, written in the background or not, resumed
how, and the node-local tier beside the shared one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .fields import Problem, setting

if TYPE_CHECKING:
    from .run import RunConfig

LLAMA3_GPU_MTBF_H = 50700.0  # 54 days x 16,384 GPUs / 419 interruptions (arXiv 2407.21783)


@dataclass(frozen=True)
class CheckpointConfig:
    every_steps: int = setting(200, "steps between checkpoints (0 = off)", min=0)
    every_minutes: float = setting(
        0.0, "minutes between checkpoints, agreed by all ranks (0 = off)", min=0.0
    )
    keep_last: int = setting(3, "checkpoints kept besides the best one (at least 2)")
    resume: str = setting(
        "auto", "auto: the latest valid checkpoint of the run; never; or a checkpoint path"
    )
    async_save: bool = setting(
        False, "copy state to memory at the step and write it in the background"
    )
    local_dir: str = setting(
        "", "a node-local folder for frequent checkpoints, $VARS expanded on each node ('' = off)"
    )
    local_every_steps: int | Literal["auto"] = setting(
        0,
        "steps between node-local checkpoints (0 = off); auto: by the clock, every "
        "sqrt(2 x a local save's stall x the job's MTBF) seconds, which loses least to saves and "
        "failures together (Young/Daly)",
        min=0,
    )
    local_keep: int = setting(2, "node-local checkpoints kept on each node", min=1)
    gpu_mtbf_hours: float = setting(
        LLAMA3_GPU_MTBF_H,
        "a rank's mean time between failures in hours, for local_every_steps: auto (the job's is "
        "this over its ranks); the default is Llama 3's: 419 interruptions in 54 days on 16,384 "
        "GPUs",
        min=1e-6,
    )
    local_replicas: int = setting(
        1, "1: each node's local checkpoint also kept on the next node; 0: not", min=0, max=1
    )


def checkpoint_rules(cfg: RunConfig) -> Problem:
    if cfg.checkpoint.keep_last < 2:
        return "checkpoint.keep_last", (
            f"{cfg.checkpoint.keep_last} is below 2: the newest checkpoint may be half-written "
            "when a job dies, so the one before it must survive rotation"
        )
    ckpt = cfg.checkpoint
    if bool(ckpt.local_dir) != bool(ckpt.local_every_steps):
        key = "checkpoint.local_every_steps" if ckpt.local_dir else "checkpoint.local_dir"
        return key, (
            "the node-local tier needs both checkpoint.local_dir (a folder on each node's own "
            "disk, such as $SLURM_TMPDIR/qgtrain) and checkpoint.local_every_steps (steps between "
            "its saves); set both, or neither"
        )
    return None
