"""Which node a failed step points at: the one a spare takes the place of, or a step on fewer
nodes leaves out (recovery.py). The strongest sign first:

    srun said the node failed ("Node failure on node2")   it stopped answering
    the ranks that left no NCCL dump all ran on one node  they died or hung first (aborts.py)
    a node of a failing task failed before in this run    status.json's failures
    the node of the first task srun said failed           the one the others were stopped for

None where srun named no node. No torch: `qgtrain recover` answers at once on the batch node.
"""

from __future__ import annotations

from dataclasses import dataclass

from .aborts import Abort
from .srun_log import TaskFailure


@dataclass(frozen=True)
class Suspect:
    node: str
    why: str  # what points at it, as the retry's reason tells it


def suspect(
    failures: list[TaskFailure],
    lost: list[str],
    nccl: Abort | None,
    earlier: dict[str, int],
) -> Suspect | None:
    """`failures`: srun's task lines, in its order; `lost`: the nodes it said failed; `nccl`:
    what NCCL's aborts and dumps say; `earlier`: this run's failures per node before this one."""
    if lost:
        return Suspect(lost[0], f"srun: Node failure on {lost[0]}")
    node_of = {failure.rank: failure.node for failure in failures}
    if nccl is not None and nccl.silent:
        nodes = {node_of.get(rank) for rank in nccl.silent}
        if len(nodes) == 1 and (node := nodes.pop()) is not None:
            shown = ",".join(map(str, nccl.silent))
            return Suspect(node, f"rank(s) {shown} on {node} left no NCCL dump")
    again = [f for f in failures if earlier.get(f.node, 0) > 0]
    if again:
        worst = max(again, key=lambda f: earlier[f.node])  # the first of the most failed
        return Suspect(
            worst.node,
            f"rank {worst.rank} on {worst.node}: {worst.how}, a node that failed "
            f"{earlier[worst.node]} time(s) before in this run",
        )
    if failures:
        first = failures[0]
        return Suspect(first.node, f"rank {first.rank} on {first.node}: {first.how}")
    return None
