"""Who this process is in the job: the environment turned into a frozen DistEnv, and nothing else.

This is the only module that reads launcher variables. A torchrun launch is known by torchrun's own
markers (TORCHELASTIC_RUN_ID, LOCAL_WORLD_SIZE, GROUP_RANK), and its variables win. Then a Slurm
step (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, the nodelist, the job id): its layout stands even
where a container hook (enroot's 50-slurm-pytorch.sh under pyxis) has copied it into RANK,
LOCAL_RANK and WORLD_SIZE, which must then agree. Then RANK, WORLD_SIZE and LOCAL_RANK set by any
other launcher; with none, the run is one process.

Under Slurm the rendezvous port comes from the job id, restart count and step id. MASTER_ADDR and
MASTER_PORT in the environment override what Slurm gives, except the hook's MASTER_PORT (job id %
4536 + 61000, the same on every restart), which is replaced; QGTRAIN_MASTER_PORT pins a port
whatever else is set.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from typing import Literal, TypedDict

from ..foundation.errors import RendezvousError
from .slurm_values import (
    HOOK_PORT_BASE,
    HOOK_PORT_MODULUS,
    expand_nodelist,
    hook_port,
    port_for_job,
    tasks_per_node,
)

_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_TORCHRUN_MARKERS = ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK")
_HOOK_COPIES = (
    ("RANK", "rank", "SLURM_PROCID"),
    ("LOCAL_RANK", "local_rank", "SLURM_LOCALID"),
    ("WORLD_SIZE", "world_size", "SLURM_NTASKS"),
)


@dataclass(frozen=True)
class DistEnv:
    """The rendezvous of one process. Which GPU it uses is devices.choose's decision, from
    `cuda_visible_devices` and what CUDA counts."""

    launcher: Literal["single", "torchrun", "slurm"] = "single"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    node_name: str = "localhost"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    port_source: str = "one process needs no port"
    job_id: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    restart_count: int = 0
    step_id: int = 0
    cpus_per_task: int | None = None
    # Unix time of the job's time limit, where Slurm says (SLURM_JOB_END_TIME)
    job_end_time: float | None = None
    # Unix time this allocation began: SLURM_JOB_START_TIME, else the batch script's start
    job_start_time: float | None = None
    # started by sbatch (ENVIRONMENT=BATCH), not srun or salloc from a shell
    batch_job: bool = False
    # as the launcher left it; None: unset, every GPU of the node shows
    cuda_visible_devices: str | None = None
    comm_env: tuple[tuple[str, str], ...] = ()  # NCCL_*, GLOO_*, TORCH_* as the job set them

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def in_slurm_job(self) -> bool:
        return self.job_id is not None

    @property
    def requeue_id(self) -> str | None:
        """The id `scontrol requeue` needs: `<array job>_<task>` for array jobs, else the job id."""
        if self.array_job_id and self.array_task_id:
            return f"{self.array_job_id}_{self.array_task_id}"
        return self.job_id

    def describe(self) -> dict[str, object]:
        return {**asdict(self), "comm_env": dict(self.comm_env), "requeue_id": self.requeue_id}


def from_environ(env: Mapping[str, str], hostname: str | None = None) -> DistEnv:
    """Build the DistEnv for this process from an environment mapping (normally os.environ)."""
    comm_env = tuple(
        sorted((k, v) for k, v in env.items() if k.startswith(("NCCL_", "GLOO_", "TORCH_")))
    )
    return replace(
        _launch(
            env, env.get("SLURMD_NODENAME") or hostname or socket.gethostname(), _slurm_job(env)
        ),
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
        comm_env=comm_env,
    )


def _launch(env: Mapping[str, str], node_name: str, job: JobFacts) -> DistEnv:
    if any(name in env for name in _TORCHRUN_MARKERS):
        return _from_torchrun(env, node_name, job)
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return _from_slurm_step(env, node_name, job)
    if "SLURM_JOB_ID" in env and _int(env, "SLURM_NTASKS", 1) > 1:
        raise RendezvousError(
            f"this process runs inside Slurm job {env['SLURM_JOB_ID']} with SLURM_NTASKS="
            f"{env['SLURM_NTASKS']}, but not under srun, so every task would believe it is rank 0. "
            "HINT: start training with `srun python -m qgtrain train ...` (train.slurm does), "
            "or request --ntasks=1 for a single process"
        )
    if any(name in env for name in _RANK_VARS):
        return _from_torchrun(env, node_name, job)
    return DistEnv(node_name=node_name, **job)


class JobFacts(TypedDict, total=False):
    job_id: str
    array_job_id: str | None
    array_task_id: str | None
    restart_count: int
    step_id: int
    cpus_per_task: int | None
    job_end_time: float | None
    job_start_time: float | None
    batch_job: bool


def _slurm_job(env: Mapping[str, str]) -> JobFacts:
    """The job facts that hold whichever launcher started the ranks (requeue needs them under
    torchrun too)."""
    if "SLURM_JOB_ID" not in env:
        return {}
    step = env.get("SLURM_STEP_ID", "")
    # Slurm's own where it sets it, else when the batch script began (sbatch.py exports it)
    began = _int(env, "SLURM_JOB_START_TIME", 0) or _int(env, "QGTRAIN_BATCH_START", 0)
    return {
        "job_id": env["SLURM_JOB_ID"],
        "array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
        "array_task_id": env.get("SLURM_ARRAY_TASK_ID"),
        # unset on a job's first run, then 1, 2, ... after each requeue
        "restart_count": _int(env, "SLURM_RESTART_COUNT", 0),
        # 0, 1, ... per srun; the batch step has none
        "step_id": int(step) if step.isdigit() else 0,
        "cpus_per_task": _int(env, "SLURM_CPUS_PER_TASK", 0) or None,
        "job_end_time": float(_int(env, "SLURM_JOB_END_TIME", 0)) or None,
        "job_start_time": float(began) or None,
        # Slurm sets it in a batch script and its steps; only batch jobs can be requeued
        "batch_job": env.get("ENVIRONMENT") == "BATCH",
    }


def _from_torchrun(env: Mapping[str, str], node_name: str, job: JobFacts) -> DistEnv:
    missing = [name for name in _RANK_VARS if name not in env]
    if missing:
        present = ", ".join(f"{n}={env[n]}" for n in _RANK_VARS if n in env) or ", ".join(
            f"{n}={env[n]}" for n in _TORCHRUN_MARKERS if n in env
        )
        raise RendezvousError(
            f"{present} is set but {', '.join(missing)} is not: a torchrun-style launch needs "
            f"all of {', '.join(_RANK_VARS)}. HINT: launch with torchrun, or unset them"
        )
    world_size = _int(env, "WORLD_SIZE", 1)
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", world_size)
    dist = DistEnv(
        launcher="torchrun",
        rank=_int(env, "RANK", 0),
        local_rank=_int(env, "LOCAL_RANK", 0),
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=_int(env, "GROUP_RANK", _int(env, "RANK", 0) // max(local_world_size, 1)),
        num_nodes=max(world_size // max(local_world_size, 1), 1),
        node_name=node_name,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", 29500),
        port_source="MASTER_PORT from the launcher"
        if "MASTER_PORT" in env
        else "torchrun's default",
        **job,
    )
    _check_ranks(dist, "RANK", "WORLD_SIZE", "LOCAL_RANK")
    return dist


def _from_slurm_step(env: Mapping[str, str], node_name: str, job: JobFacts) -> DistEnv:
    world_size = _int(env, "SLURM_NTASKS", 1)
    step_tasks = _int(env, "SLURM_STEP_NUM_TASKS", world_size)
    if step_tasks != world_size:
        raise RendezvousError(
            f"SLURM_NTASKS={world_size} does not match this step's "
            f"SLURM_STEP_NUM_TASKS={step_tasks}. HINT: let srun take the task count from the "
            "allocation (no -n/--ntasks that differs from #SBATCH)"
        )
    # The step's nodelist is where its rank 0 runs; it equals the job's unless srun uses part of the
    # allocation.
    nodelist = (
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    )
    if not nodelist:
        raise RendezvousError(
            "SLURM_JOB_NODELIST is not set inside a Slurm step; cannot find the master host"
        )
    hosts = expand_nodelist(nodelist)
    node_rank = _int(env, "SLURM_NODEID", 0)
    per_node = tasks_per_node(
        env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1"
    )
    if len(per_node) != len(hosts) or sum(per_node) != world_size:
        raise RendezvousError(
            f"SLURM_NTASKS={world_size} does not match the allocation: {len(hosts)} node(s) "
            f"({nodelist}) with tasks per node {per_node}. HINT: request --ntasks-per-node=<GPUs "
            "per node> with --nodes, not a total --ntasks that does not divide evenly"
        )
    if not 0 <= node_rank < len(hosts):
        raise RendezvousError(
            f"SLURM_NODEID={node_rank} is outside the {len(hosts)} node(s) of {nodelist}"
        )
    dist = DistEnv(
        launcher="slurm",
        rank=_int(env, "SLURM_PROCID", 0),
        local_rank=_int(env, "SLURM_LOCALID", 0),
        world_size=world_size,
        local_world_size=per_node[node_rank],
        node_rank=node_rank,
        num_nodes=len(hosts),
        node_name=node_name,
        master_addr=env.get("MASTER_ADDR") or hosts[0],
        **job,
    )
    port, source = _slurm_port(env, job.get("job_id", ""), dist.restart_count, dist.step_id)
    dist = replace(dist, master_port=port, port_source=source)
    _check_hook_copies(env, dist)
    _check_ranks(dist, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    return dist


def _slurm_port(env: Mapping[str, str], job_id: str, restart: int, step: int) -> tuple[int, str]:
    """The port and why: pinned, given, or derived (also in place of a container hook's fixed
    port)."""
    if env.get("QGTRAIN_MASTER_PORT", "").strip():
        return _int(env, "QGTRAIN_MASTER_PORT", 0), "pinned by QGTRAIN_MASTER_PORT"
    derived = port_for_job(job_id, restart, step)
    how = f"derived from Slurm job {job_id}, restart {restart}, step {step}"
    given = _int(env, "MASTER_PORT", 0)
    if not given:
        return derived, how
    if given == hook_port(job_id):
        return derived, (
            f"{how}, in place of MASTER_PORT={given} from a container hook (job id % "
            f"{HOOK_PORT_MODULUS} + {HOOK_PORT_BASE}: the same on every restart); "
            "QGTRAIN_MASTER_PORT pins a port"
        )
    return given, "MASTER_PORT from the environment"


def _check_hook_copies(env: Mapping[str, str], dist: DistEnv) -> None:
    """RANK, LOCAL_RANK and WORLD_SIZE inside a Slurm step (a container hook copies them from
    SLURM_*) must describe the same layout as Slurm's own variables; qgtrain takes Slurm's."""
    for name, field, slurm_name in _HOOK_COPIES:
        if name in env and _int(env, name, -1) != getattr(dist, field):
            raise RendezvousError(
                f"{name}={env[name]} contradicts this srun step's "
                f"{slurm_name}={getattr(dist, field)}: something (a container hook, the job "
                f"script) set {name} for another layout. HINT: unset RANK, LOCAL_RANK and "
                "WORLD_SIZE before srun (qgtrain takes the layout from Slurm), or launch with "
                "torchrun"
            )


def _check_ranks(dist: DistEnv, rank_var: str, world_var: str, local_var: str) -> None:
    if dist.world_size < 1 or not 0 <= dist.rank < dist.world_size:
        raise RendezvousError(
            f"{rank_var}={dist.rank} is outside {world_var}={dist.world_size}: "
            "ranks run from 0 to world size - 1"
        )
    if not 0 <= dist.local_rank < dist.local_world_size:
        raise RendezvousError(
            f"{local_var}={dist.local_rank} is outside the {dist.local_world_size} task(s) "
            f"on node {dist.node_name}"
        )
    if not 0 < dist.master_port < 65536:
        name = "QGTRAIN_MASTER_PORT" if "QGTRAIN_MASTER_PORT" in dist.port_source else "MASTER_PORT"
        raise RendezvousError(f"{name}={dist.master_port} is not a TCP port (1-65535)")


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise RendezvousError(f"{name}={text!r} is not an integer") from None
