"""What srun says when a step fails: which tasks failed, on which node, how, and which nodes it
lost. Read by `qgtrain recover` (recovery.py) from the step's stderr, which the batch script keeps.
The lines are srun's own: one for each task that ended badly, and one for a node that stopped
answering (its _node_fail_handler), whose tasks may get no line."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..foundation.errors import RendezvousError
from ..runtime.slurm_values import expand_nodelist

_TASK_LINE = re.compile(r"^srun: error: (?P<node>\S+): tasks? (?P<ranks>[\d,-]+): (?P<how>.+?)\s*$")
# srun's _node_fail_handler: a node of the step stopped answering (its tasks may get no line)
_NODE_LINE = re.compile(r"^srun: error: Node failure on (?P<nodes>\S+)\s*$")


@dataclass(frozen=True)
class TaskFailure:
    """What srun said of the first task that failed: the one the others were stopped for."""

    node: str
    rank: int
    how: str  # "Killed", "Exited with exit code 1", "Segmentation fault", ...


def task_failures(srun_log: str) -> list[TaskFailure]:
    """Every task srun reported, one per rank ("tasks 4-7" is four), in srun's order."""
    found = []
    for line in srun_log.splitlines():
        match = _TASK_LINE.match(line)
        if match:
            for part in match.group("ranks").split(","):
                first, _, last = part.partition("-")
                found += [
                    TaskFailure(match.group("node"), rank, match.group("how"))
                    for rank in range(int(first), int(last or first) + 1)
                ]
    return found


def lost_nodes(srun_log: str) -> list[str]:
    """The nodes srun said failed ("Node failure on node[2-3]" is two), in srun's order."""
    found: list[str] = []
    for line in srun_log.splitlines():
        if match := _NODE_LINE.match(line):
            try:
                found += expand_nodelist(match.group("nodes"))
            except RendezvousError:  # not a hostlist: the name as srun wrote it
                found.append(match.group("nodes"))
    return found
