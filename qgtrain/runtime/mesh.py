"""Which ranks hold one copy of a sharded model: all of them (fsdp), or the ranks of one node
(hsdp).

HSDP shards the model within a shard group (the ranks of a node: all-gathers and reduce-scatters
stay on the node's fast links) and replicates it across groups (one all-reduce of the gradient
shards per step crosses the network), as FSDP2 does on a 2-D mesh (replicate, shard). The groups
come from where the ranks run (each rank's node, as Slurm or torchrun says), or from
train.shard_group_size. Ranks are put in groups by node, not by rank number, so a cyclic Slurm
distribution still keeps a group on one node.

DeviceMesh would make the 2-D mesh's groups with gloo's default half-hour timeout; they are made
here with train.collective_timeout_s instead, so a cut-off node fails the others within that bound.
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..foundation.errors import ConfigError
from . import objects
from .rendezvous import DistEnv

log = logging.getLogger("qgtrain")


def shard_groups(node_of_rank: list[int], shard_group_size: int) -> list[list[int]]:
    """Shard groups (rows of the mesh) from each rank's node: the ranks of a node, or groups of
    `shard_group_size` ranks taken node by node. One row is plain fsdp."""
    nodes = sorted(set(node_of_rank))
    by_node = [[rank for rank, node in enumerate(node_of_rank) if node == n] for n in nodes]
    counts = [len(ranks) for ranks in by_node]
    world = len(node_of_rank)
    if not shard_group_size and len(set(counts)) > 1:
        raise ConfigError(
            "train.parallel: hsdp needs the same number of ranks on every node, but the "
            f"{len(nodes)} nodes run {', '.join(map(str, counts))} ranks. HINT: launch with "
            "--ntasks-per-node (one rank per GPU), or set train.shard_group_size to a divisor of "
            f"the {world} ranks"
        )
    size = shard_group_size or counts[0]
    if world % size:
        raise ConfigError(
            f"train.shard_group_size: {size} does not divide the {world} ranks of this job into "
            "groups of equal size. HINT: use a divisor of the rank count, such as the ranks per "
            "node, or 0 for one group per node"
        )
    ordered = [rank for ranks in by_node for rank in ranks]
    return [ordered[i : i + size] for i in range(0, world, size)]


def flat_mesh(world_size: int, device: torch.device) -> Any:
    """The mesh fsdp shards on: 1-D over every rank."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world_size,))


def hsdp_mesh(train: TrainConfig, env: DistEnv, device: torch.device) -> Any:
    """The mesh hsdp shards on: 2-D, one row per shard group, or 1-D with one group (a
    collective)."""
    nodes: list[int] = objects.all_gather(env.node_rank, what="node number")
    rows = shard_groups(nodes, train.shard_group_size)
    if len(rows) == 1:
        log.info(
            "hsdp: one shard group of %d ranks, so the model is sharded as under fsdp",
            env.world_size,
        )
        return flat_mesh(env.world_size, device)
    log.info(
        "hsdp: %d replicas of the model, each sharded over %d ranks (%s)",
        len(rows),
        len(rows[0]),
        "; ".join(",".join(map(str, row)) for row in rows),
    )
    return two_d_mesh(rows, device.type, train.collective_timeout_s)


def two_d_mesh(
    rows: list[list[int]], device_type: str, timeout_s: float, backend: str | None = None
) -> Any:
    """A (replicate, shard) mesh whose rows are the shard groups, its groups made with `timeout_s`:
    DeviceMesh makes its own with the backend's default (half an hour for gloo), and a rank cut off
    would hang the rest that long. A collective: every rank calls it with the same rows."""
    from torch.distributed.device_mesh import DeviceMesh

    timeout = datetime.timedelta(seconds=timeout_s)
    shard, _ = dist.new_subgroups_by_enumeration(rows, timeout=timeout, backend=backend)
    replicate, _ = dist.new_subgroups_by_enumeration(
        [list(column) for column in zip(*rows)], timeout=timeout, backend=backend
    )
    return DeviceMesh.from_group(
        [replicate, shard],
        device_type,
        mesh=torch.tensor(rows, dtype=torch.int),
        mesh_dim_names=("replicate", "shard"),
    )
