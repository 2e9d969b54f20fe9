"""Which nodes a job can have: the partition's nodes that are up (as sinfo says), and what
exclusions leave.

Used when a job is submitted (an --exclude that leaves too few nodes is refused before sbatch sees
it) and after a failed step (a failing node is kept away from the requeued job only if another can
take its place). Where sinfo cannot answer, nothing is refused and nothing is excluded.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable

import hostlist

from ..config import SlurmConfig
from ..foundation.errors import ConfigError

Runner = Callable[..., "subprocess.CompletedProcess[str]"]
# sinfo's short states of nodes that take no job
_DOWN = ("down", "drain", "drng", "fail", "maint", "inval")


def usable_nodes(partition: str, run: Runner = subprocess.run) -> set[str] | None:
    """The partition's nodes that can run a job now (None where sinfo cannot say). No partition
    means the cluster's default one, where sbatch sends a job that names none: sinfo marks it
    with a `*` after its name."""
    command = ["sinfo", "-h", "-N", "-o", "%N %t %P", *(["-p", partition] if partition else [])]
    try:
        shown = run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if shown.returncode != 0:
        return None
    usable = set()
    for line in shown.stdout.splitlines():
        node, state, named = (line.split() + ["", ""])[:3]
        if node and not state.startswith(_DOWN) and (partition or named.endswith("*")):
            usable.add(node)
    return usable


def free_nodes(partition: str, needed: int, run: Runner = subprocess.run) -> int | None:
    """Nodes of the partition that are up beyond the `needed` ones (None where sinfo cannot say)."""
    usable = usable_nodes(partition, run)
    return None if usable is None else max(len(usable) - needed, 0)


def check_exclusions(slurm: SlurmConfig, run: Runner = subprocess.run) -> None:
    """Refuse an --exclude in slurm.extra_sbatch that leaves the partition fewer nodes than the job
    asks for: Slurm would keep it pending forever."""
    excluded = [
        option.partition("=")[2] for option in slurm.extra_sbatch if option.startswith("--exclude=")
    ]
    if not excluded:
        return
    usable = usable_nodes(slurm.partition, run)
    if usable is None:
        return
    try:
        left = usable - {node for spec in excluded for node in hostlist.expand_hostlist(spec)}
    except hostlist.BadHostlist as exc:
        raise ConfigError(
            f"slurm.extra_sbatch: --exclude={excluded[0]} is not a Slurm hostlist ({exc})"
        ) from None
    if len(left) < slurm.nodes + slurm.spare_nodes:
        where = f"partition {slurm.partition}" if slurm.partition else "the default partition"
        spares = f" and slurm.spare_nodes={slurm.spare_nodes}" if slurm.spare_nodes else ""
        raise ConfigError(
            f"slurm.extra_sbatch: --exclude={','.join(excluded)} leaves {len(left)} of the "
            f"{len(usable)} usable nodes of {where}, and the job asks for "
            f"slurm.nodes={slurm.nodes}{spares}. HINT: exclude fewer nodes, or ask for fewer"
        )
