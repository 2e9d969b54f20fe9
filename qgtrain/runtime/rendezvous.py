"""Who this process is in the job: the environment turned into a frozen DistEnv, and nothing else.

This is the only module that reads launcher variables. Precedence: torchrun's variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT) win; then Slurm's (SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, the
nodelist, the job id); with neither, the run is one process. MASTER_ADDR and MASTER_PORT in the environment
always override what is derived from Slurm.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Literal, TypedDict

import hostlist

from ..errors import RendezvousError

# Ports 20000-31999: below Linux's ephemeral range (32768-60999), so an outgoing connection never holds
# the port we want to listen on. Each job id gets RESTART_SLOTS consecutive ports, one per restart, so
# consecutive job ids (the jobs that share a node) and the restarts of one job never meet; ids
# PORT_SPAN / RESTART_SLOTS = 1500 apart do, which is as far as a fixed range allows.
PORT_BASE = 20000
PORT_SPAN = 12000
RESTART_SLOTS = 8

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class DistEnv:
    """The rendezvous of one process. `device_index` is the GPU this rank owns: always the local rank."""

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
    job_id: str | None = None
    array_job_id: str | None = None
    array_task_id: str | None = None
    restart_count: int = 0
    cpus_per_task: int | None = None
    job_end_time: float | None = None  # Unix time of the job's time limit, where Slurm says (SLURM_JOB_END_TIME)
    batch_job: bool = False  # started by sbatch (ENVIRONMENT=BATCH), not srun or salloc from a shell

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device_index(self) -> int:
        return self.local_rank

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
        return {**asdict(self), "device_index": self.device_index, "requeue_id": self.requeue_id}


def from_environ(env: Mapping[str, str], hostname: str | None = None) -> DistEnv:
    """Build the DistEnv for this process from an environment mapping (normally os.environ)."""
    node_name = env.get("SLURMD_NODENAME") or hostname or socket.gethostname()
    job = _slurm_job(env)
    if any(name in env for name in _TORCHRUN_VARS):
        return _from_torchrun(env, node_name, job)
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return _from_slurm_step(env, node_name, job)
    if "SLURM_JOB_ID" in env and _int(env, "SLURM_NTASKS", 1) > 1:
        raise RendezvousError(
            f"this process runs inside Slurm job {env['SLURM_JOB_ID']} with SLURM_NTASKS="
            f"{env['SLURM_NTASKS']}, but not under srun, so every task would believe it is rank 0. "
            "HINT: start training with `srun python -m qgtrain train ...` (train.slurm does), "
            "or request --ntasks=1 for a single process")
    return DistEnv(node_name=node_name, **job)


def expand_nodelist(nodelist: str) -> list[str]:
    """Hosts of a Slurm hostlist (`gpu[01-04,07]`, `a1,b[2-3]`), in the order `scontrol show hostnames` prints."""
    try:
        hosts = hostlist.expand_hostlist(nodelist)
    except hostlist.BadHostlist as exc:
        raise RendezvousError(f"SLURM_JOB_NODELIST={nodelist!r} is not a valid Slurm hostlist ({exc})") from None
    if not hosts:
        raise RendezvousError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return hosts


def port_for_job(job_id: str, restart_count: int) -> int:
    """The rendezvous port of a job's allocation: the same on every rank, different per job and restart."""
    digits = re.sub(r"\D", "", job_id)
    if not digits:
        raise RendezvousError(f"SLURM_JOB_ID={job_id!r} is not a job id; expected digits")
    return PORT_BASE + (int(digits) * RESTART_SLOTS + restart_count % RESTART_SLOTS) % PORT_SPAN


def tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's compressed task counts: '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise RendezvousError(f"SLURM_STEP_TASKS_PER_NODE={spec!r} is not a Slurm task count such as '2(x3),1'")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


class JobFacts(TypedDict, total=False):
    job_id: str
    array_job_id: str | None
    array_task_id: str | None
    restart_count: int
    cpus_per_task: int | None
    job_end_time: float | None
    batch_job: bool


def _slurm_job(env: Mapping[str, str]) -> JobFacts:
    """The job facts that hold whichever launcher started the ranks (requeue needs them under torchrun too)."""
    if "SLURM_JOB_ID" not in env:
        return {}
    return {
        "job_id": env["SLURM_JOB_ID"],
        "array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
        "array_task_id": env.get("SLURM_ARRAY_TASK_ID"),
        # unset on a job's first run, then 1, 2, ... after each requeue
        "restart_count": _int(env, "SLURM_RESTART_COUNT", 0),
        "cpus_per_task": _int(env, "SLURM_CPUS_PER_TASK", 0) or None,
        "job_end_time": float(_int(env, "SLURM_JOB_END_TIME", 0)) or None,
        # Slurm sets it in a batch script and its steps; only batch jobs can be requeued
        "batch_job": env.get("ENVIRONMENT") == "BATCH",
    }


def _from_torchrun(env: Mapping[str, str], node_name: str, job: JobFacts) -> DistEnv:
    missing = [name for name in _TORCHRUN_VARS if name not in env]
    if missing:
        present = ", ".join(f"{n}={env[n]}" for n in _TORCHRUN_VARS if n in env)
        raise RendezvousError(f"{present} is set but {', '.join(missing)} is not: a torchrun-style launch needs "
                              f"all of {', '.join(_TORCHRUN_VARS)}. HINT: launch with torchrun, or unset them")
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
        **job,
    )
    _check_ranks(dist, "RANK", "WORLD_SIZE", "LOCAL_RANK")
    return dist


def _from_slurm_step(env: Mapping[str, str], node_name: str, job: JobFacts) -> DistEnv:
    world_size = _int(env, "SLURM_NTASKS", 1)
    step_tasks = _int(env, "SLURM_STEP_NUM_TASKS", world_size)
    if step_tasks != world_size:
        raise RendezvousError(
            f"SLURM_NTASKS={world_size} does not match this step's SLURM_STEP_NUM_TASKS={step_tasks}. "
            "HINT: let srun take the task count from the allocation (no -n/--ntasks that differs from #SBATCH)")
    # The step's nodelist is where its rank 0 runs; it equals the job's unless srun uses part of the allocation.
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise RendezvousError("SLURM_JOB_NODELIST is not set inside a Slurm step; cannot find the master host")
    hosts = expand_nodelist(nodelist)
    node_rank = _int(env, "SLURM_NODEID", 0)
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or "1")
    if len(per_node) != len(hosts) or sum(per_node) != world_size:
        raise RendezvousError(
            f"SLURM_NTASKS={world_size} does not match the allocation: {len(hosts)} node(s) ({nodelist}) with "
            f"tasks per node {per_node}. HINT: request --ntasks-per-node=<GPUs per node> with --nodes, "
            "not a total --ntasks that does not divide evenly")
    if not 0 <= node_rank < len(hosts):
        raise RendezvousError(f"SLURM_NODEID={node_rank} is outside the {len(hosts)} node(s) of {nodelist}")
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
        master_port=_int(env, "MASTER_PORT", 0) or port_for_job(job.get("job_id", ""), job.get("restart_count", 0)),
        **job,
    )
    _check_ranks(dist, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID")
    return dist


def _check_ranks(dist: DistEnv, rank_var: str, world_var: str, local_var: str) -> None:
    if dist.world_size < 1 or not 0 <= dist.rank < dist.world_size:
        raise RendezvousError(f"{rank_var}={dist.rank} is outside {world_var}={dist.world_size}: "
                              "ranks run from 0 to world size - 1")
    if not 0 <= dist.local_rank < dist.local_world_size:
        raise RendezvousError(f"{local_var}={dist.local_rank} is outside the {dist.local_world_size} task(s) "
                              f"on node {dist.node_name}")
    if not 0 < dist.master_port < 65536:
        raise RendezvousError(f"MASTER_PORT={dist.master_port} is not a TCP port (1-65535)")


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name)
    if text is None or text.strip() == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise RendezvousError(f"{name}={text!r} is not an integer") from None
