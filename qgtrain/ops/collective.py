"""`srun qgtrain doctor --collective`: how fast the allocation's nodes exchange data, and which node
is slow.

Every rank all-reduces a few sizes together; then the first rank of each node all-reduces with the
first rank of every other node, pair by pair (a round-robin schedule, so pairs that share no node
run at once), which gives each link between two nodes a bus bandwidth of its own. A node is named as
slow when the best of its links carries less than a 1/SLOW_FACTOR share of the best link between the
other nodes: one bad node slows every link it is on, while the links between the others stay fast.
On GPUs this runs over NCCL on each rank's own GPU, on CPUs over gloo. A node that never answers
makes the collectives time out; the ranks that do not answer are then named from the rendezvous
store.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..foundation.errors import ConfigError

SLOW_FACTOR = 2.0
ITERATIONS = 5
PAIR_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Verdict:
    level: str  # ok, warning, error
    message: str
    fix: str = ""


def parse_sizes(text: str) -> list[float]:
    """`--collective 1,16,64`: all-reduce sizes in MB."""
    try:
        sizes = [float(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(not 0 < size <= 4096 for size in sizes):
        raise ConfigError(
            f"--collective {text!r}: give sizes in MB between 0 and 4096, e.g. 1,16,64"
        )
    return sizes


def rounds(count: int) -> list[list[tuple[int, int]]]:
    """Every pair of `count` nodes exactly once, in rounds of pairs that share no node (the circle
    method)."""
    slots = list(range(count)) + ([None] if count % 2 else [])
    schedule = []
    for _ in range(len(slots) - 1):
        half = len(slots) // 2
        pairs = [(slots[i], slots[-1 - i]) for i in range(half)]
        schedule.append(
            [(min(a, b), max(a, b)) for a, b in pairs if a is not None and b is not None]
        )
        slots = [slots[0], slots[-1], *slots[1:-1]]
    return [turn for turn in schedule if turn]


def bus_gbps(size_bytes: int, seconds: float, ranks: int) -> float:
    """All-reduce bus bandwidth as nccl-tests defines it: the bytes each rank moves, whatever the
    count."""
    return size_bytes / seconds * 2 * (ranks - 1) / ranks / 1e9


def judge(
    nodes: Sequence[str],
    links: dict[tuple[str, str], float | None],
    silent: Sequence[str] = (),
    factor: float = SLOW_FACTOR,
) -> Verdict:
    """Name the slow or silent nodes from each pair's bus bandwidth (None: the pair did not
    finish)."""
    if len(nodes) < 2 and not silent:
        return Verdict("ok", "one node: no link between nodes to compare")
    if silent:
        return Verdict(
            "error",
            f"node(s) {', '.join(silent)} never answered the collectives",
            f"check those nodes (`scontrol show node`); exclude them with sbatch --exclude="
            f"{','.join(silent)}",
        )
    slow: dict[str, str] = {}
    for node in nodes:
        own = [bw or 0.0 for pair, bw in links.items() if node in pair]
        others = [bw or 0.0 for pair, bw in links.items() if node not in pair]
        if own and others and max(others) >= factor * max(own):
            slow[node] = (
                f"{node} (its best link {max(own):.3g} GB/s against {max(others):.3g} GB/s between "
                "others)"
            )
    if slow:
        return Verdict(
            "error",
            f"slower than the others by more than {factor:g}x: {'; '.join(slow.values())}",
            f"leave it out (sbatch --exclude={','.join(slow)}) and tell the cluster's admins; "
            "`srun qgtrain doctor` lists each node's interfaces",
        )
    if len(nodes) == 2:
        return Verdict(
            "ok", "one link only: a slow node cannot be told from a slow link with two nodes"
        )
    return Verdict("ok", f"no node is slower than the others by more than {factor:g}x")


def measure(env: Any, device: Any, sizes_mb: Sequence[float]) -> dict[str, Any] | None:
    """Run the all-reduces (a collective: every rank calls this inside the process group). Rank 0
    gets the nodes, the whole allocation's bandwidth per size and each link's at the largest size;
    the others None."""
    import torch.distributed as dist

    from ..runtime import distributed, objects

    everyone = objects.all_gather(
        (env.node_rank, env.node_name, env.rank if env.local_rank == 0 else None), what="node"
    )
    leaders = sorted(tuple(x) for x in everyone if x[2] is not None)
    whole = {
        mb: bus_gbps(_bytes(mb), _timed(device, _bytes(mb), None), env.world_size)
        for mb in sizes_mb
    }
    groups = {
        (a, b): dist.new_group(
            [leaders[a][2], leaders[b][2]], timeout=datetime.timedelta(seconds=PAIR_TIMEOUT_S)
        )
        for turn in rounds(len(leaders))
        for a, b in turn
    }
    mine: dict[tuple[str, str], float] = {}
    for turn in rounds(len(leaders)):
        for a, b in turn:
            if env.local_rank == 0 and env.node_rank in (leaders[a][0], leaders[b][0]):
                seconds = _timed(device, _bytes(max(sizes_mb)), groups[(a, b)])
                mine[(leaders[a][1], leaders[b][1])] = bus_gbps(_bytes(max(sizes_mb)), seconds, 2)
        distributed.barrier()
    gathered = distributed.gather_to_main(mine)
    if gathered is None:
        return None
    links = {pair: bw for part in gathered for pair, bw in part.items()}
    return {"nodes": [name for _, name, _ in leaders], "whole": whole, "links": links}


def _bytes(mb: float) -> int:
    return max(4, int(mb * 1e6) // 4 * 4)


def _timed(device: Any, size_bytes: int, group: Any) -> float:
    """Seconds per all-reduce of `size_bytes` float32, after one untimed all-reduce that also waits
    for every rank of the group (so a partner still busy elsewhere is not counted)."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(size_bytes // 4, dtype=torch.float32, device=device)
    dist.all_reduce(tensor, group=group)
    _wait(device)
    start = time.perf_counter()
    for _ in range(ITERATIONS):
        dist.all_reduce(tensor, group=group)
    _wait(device)
    return (time.perf_counter() - start) / ITERATIONS


def _wait(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def render(result: dict[str, Any], world_size: int) -> tuple[str, str]:
    """Two lines: the whole allocation's bandwidth per size, and each link's."""
    whole = ", ".join(f"{mb:g} MB {gbps:.3g} GB/s" for mb, gbps in result["whole"].items())
    links = ", ".join(
        f"{a}-{b} {gbps:.3g} GB/s" for (a, b), gbps in sorted(result["links"].items())
    )
    return (
        f"all-reduce over {world_size} ranks on {len(result['nodes'])} node(s), bus bandwidth: "
        f"{whole}",
        f"node pairs at {max(result['whole']):g} MB: {links or 'none (one node)'}",
    )
