"""What Slurm writes, read as values: a hostlist, compressed task counts, a job id; and the
rendezvous port a job's id, restart and step derive. Pure functions of the strings, no environment:
rendezvous.py reads the variables and passes their text here.
"""

from __future__ import annotations

import re

import hostlist

from ..foundation.errors import RendezvousError

# Ports 20000-31999: below Linux's ephemeral range (32768-60999), so an outgoing connection never
# holds the port we want to listen on. Each job id owns RESTART_SLOTS x STEP_SLOTS consecutive
# ports, one per restart and srun step, so consecutive job ids (the jobs that share a node), the
# restarts of one job and the steps of one allocation never meet; job ids PORT_SPAN / (RESTART_SLOTS
# * STEP_SLOTS) = 375 apart do, which is as far as a fixed range allows. Restarts 8 apart and steps
# 4 apart share a port: they never run at once.
PORT_BASE = 20000
PORT_SPAN = 12000
RESTART_SLOTS = 8
STEP_SLOTS = 4
# enroot's hook: MASTER_PORT = SLURM_JOB_ID % 4536 + 61000 (conf/hooks/extra/50-slurm-pytorch.sh)
HOOK_PORT_BASE, HOOK_PORT_MODULUS = 61000, 4536


def expand_nodelist(nodelist: str) -> list[str]:
    """Hosts of a Slurm hostlist (`gpu[01-04,07]`, `a1,b[2-3]`, `a1 b2`), in the order `scontrol
    show hostnames` prints: parts are separated by commas, spaces or tabs outside brackets, as
    Slurm's own parser splits them (python-hostlist splits on commas only)."""
    hosts: list[str] = []
    # runs of anything but separators, or [...]
    for part in re.findall(r"(?:\[[^\]]*\]|[^\s,])+", nodelist):
        try:
            hosts += hostlist.expand_hostlist(part)
        except hostlist.BadHostlist as exc:
            raise RendezvousError(
                f"SLURM_JOB_NODELIST={nodelist!r} is not a valid Slurm hostlist ({exc})"
            ) from None
    if not hosts:
        raise RendezvousError(f"SLURM_JOB_NODELIST={nodelist!r} names no host")
    return hosts


def port_for_job(job_id: str, restart_count: int, step_id: int = 0) -> int:
    """The rendezvous port of one srun step: the same on every rank, different per job, restart and
    step."""
    slot = (restart_count % RESTART_SLOTS) * STEP_SLOTS + step_id % STEP_SLOTS
    return PORT_BASE + (_job_number(job_id) * RESTART_SLOTS * STEP_SLOTS + slot) % PORT_SPAN


def hook_port(job_id: str) -> int:
    """The MASTER_PORT enroot's PyTorch hook gives every step and restart of a job."""
    return _job_number(job_id) % HOOK_PORT_MODULUS + HOOK_PORT_BASE


def _job_number(job_id: str) -> int:
    digits = re.sub(r"\D", "", job_id)
    if not digits:
        raise RendezvousError(f"SLURM_JOB_ID={job_id!r} is not a job id; expected digits")
    return int(digits)


def tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's compressed task counts: '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not match:
            raise RendezvousError(
                f"SLURM_STEP_TASKS_PER_NODE={spec!r} is not a Slurm task count such as '2(x3),1'"
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
