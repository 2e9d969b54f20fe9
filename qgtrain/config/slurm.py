"""The slurm section: what `qgtrain submit` asks of the scheduler, and how a job recovers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from ..foundation.errors import ConfigError
from .fields import Problem, setting

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass(frozen=True)
class SlurmConfig:
    job_name: str = setting("qgtrain", "#SBATCH --job-name")
    nodes: int = setting(1, "#SBATCH --nodes", min=1)
    gpus_per_node: int = setting(0, "GPUs per node; one task (rank) per GPU", min=0)
    tasks_per_node: int = setting(0, "ranks per node when gpus_per_node is 0 (0 = 1)", min=0)
    cpus_per_task: int = setting(4, "#SBATCH --cpus-per-task", min=1)
    mem: str = setting("", "#SBATCH --mem, e.g. 64G ('' = the cluster default)")
    time: str = setting("01:00:00", "#SBATCH --time: [days-]hours:minutes:seconds or minutes")
    partition: str = setting("", "#SBATCH --partition ('' = default)")
    account: str = setting("", "#SBATCH --account ('' = default)")
    qos: str = setting("", "#SBATCH --qos ('' = default)")
    constraint: str = setting("", "#SBATCH --constraint ('' = none)")
    signal: Literal["USR1", "USR2", "HUP", "URG"] = setting(
        "USR2",
        "the warning signal sent before the time limit; it makes every rank save and "
        "stop (NCCL has used USR1)",
    )
    signal_lead_s: int = setting(
        120, "seconds before the time limit that slurm.signal is sent", min=30, max=3600
    )
    requeue: bool = setting(True, "requeue the job after a preemption or time-limit stop")
    max_restarts: int = setting(20, "stop requeueing after this many restarts", min=0)
    step_retries: int = setting(
        2,
        "times a step that failed for a reason that may pass (a rank died, a node vanished) "
        "is run again inside the allocation before the job is requeued",
        min=0,
        max=10,
    )
    spare_nodes: int = setting(
        0,
        "nodes asked for beyond slurm.nodes and kept idle: a step that fails on a node is run "
        "again at once on a spare, without that node, in the same allocation",
        min=0,
        max=64,
    )
    min_nodes: int = setting(
        0,
        "with no spare left, a step that fails on a node is run again without it on fewer "
        "nodes, down to this many, keeping the global batch of slurm.nodes (more gradient "
        "accumulation); 0 = never fewer than slurm.nodes",
        min=0,
    )
    output_dir: str = setting("jobs/out", "where Slurm writes the job's stdout/stderr")
    extra_sbatch: tuple[str, ...] = setting((), "more #SBATCH options, e.g. ['--exclusive']")
    setup: tuple[str, ...] = setting(
        (), "shell lines run before srun, e.g. ['module load cuda/12.4']"
    )
    container_image: str = setting(
        "",
        "pyxis: run every task in this image, e.g. nvcr.io#nvidia/pytorch:24.08-py3 with "
        "qgtrain installed ('' = none)",
    )
    container_mounts: tuple[str, ...] = setting(
        (), "SRC:DST[:FLAGS] mounts into the container, besides the working directory"
    )
    apptainer_image: str = setting(
        "", "apptainer: run every task with `apptainer exec` in this image ('' = none)"
    )
    snapshot: bool = setting(
        True,
        "run every attempt of the job (requeues too) from a copy of the submit directory and "
        "qgtrain taken at submit, in <run dir>/code/<hash>",
    )
    snapshot_max_mb: float = setting(
        50.0, "refuse to submit when that copy would be larger (MB)", min=0.001
    )
    snapshot_exclude: tuple[str, ...] = setting(
        (),
        "glob patterns of more files that copy leaves out, e.g. ['data/*', '*.ckpt'] (files "
        "that look like secrets, such as .env*, *.pem, *_key, id_*, are always left out)",
    )


def ranks_per_node(slurm: SlurmConfig) -> int:
    return slurm.gpus_per_node or slurm.tasks_per_node or 1


def shrinks(slurm: SlurmConfig) -> bool:
    """Whether a step may run on fewer nodes than slurm.nodes."""
    return 0 < slurm.min_nodes < slurm.nodes


def micro_batches(slurm: SlurmConfig, grad_accum_steps: int, ranks: int) -> int:
    """Micro-batches per optimizer step for a step of the job on `ranks` ranks: under
    slurm.min_nodes, a step on fewer nodes accumulates more, so every optimizer step still takes
    the global batch of slurm.nodes (the same samples in the same order: data/loaders.py)."""
    planned = slurm.nodes * ranks_per_node(slurm)
    if not shrinks(slurm) or ranks >= planned:
        return grad_accum_steps
    whole, rest = divmod(grad_accum_steps * planned, ranks)
    if rest:
        raise ConfigError(
            f"slurm.min_nodes: a step on {ranks} rank(s) cannot keep the global batch of "
            f"slurm.nodes ({planned} ranks, train.grad_accum_steps {grad_accum_steps}): each "
            f"rank would take {grad_accum_steps * planned}/{ranks} micro-batches a step. HINT: "
            "run the step on a node count that divides them"
        )
    return whole


def slurm_rules(cfg: RunConfig) -> Problem:
    slurm, accumulate = cfg.slurm, cfg.train.grad_accum_steps
    if slurm.min_nodes > slurm.nodes:
        return "slurm.min_nodes", (
            f"{slurm.min_nodes} is more than slurm.nodes ({slurm.nodes}): the job trains on at "
            "most slurm.nodes"
        )
    if shrinks(slurm) and slurm.nodes * accumulate % slurm.min_nodes:
        return "slurm.min_nodes", (
            f"{slurm.min_nodes} node(s) cannot keep the global batch of slurm.nodes "
            f"({slurm.nodes}) with train.grad_accum_steps {accumulate}: each rank would take "
            f"{slurm.nodes * accumulate}/{slurm.min_nodes} micro-batches a step. Allowed: a "
            f"min_nodes that divides {slurm.nodes * accumulate}, or a train.grad_accum_steps "
            "that makes it divide"
        )
    return None


def runs_from_snapshot(slurm: SlurmConfig) -> bool:
    """Whether jobs run from a code snapshot: slurm.snapshot, on the host (an image brings its own
    code, and mounts only the working directory)."""
    return slurm.snapshot and not (slurm.container_image or slurm.apptainer_image)
