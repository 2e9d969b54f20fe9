"""The checks of `srun qgtrain doctor` that need this node's network or the other nodes: which
interface NCCL and gloo would use, whether every node sees the run directory, and with
`--collective` the bandwidth between the nodes. doctor.py runs them after its node-local checks.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..runtime.rendezvous import DistEnv
from .doctor import Check


def network_check(cfg: RunConfig, env: DistEnv) -> Check:
    """This node's interfaces and the one NCCL and gloo would use (train.socket_ifname, or the route
    to MASTER_ADDR)."""
    from ..foundation.errors import ConfigError
    from ..runtime import comms

    interfaces = comms.machine_interfaces()
    listed = ", ".join(
        f"{i.name} {i.address or '(no IPv4)'}{'' if i.up else ' (down)'}" for i in interfaces
    )
    try:
        choice = comms.choose_interface(
            cfg.train.socket_ifname, interfaces, comms.route_source(env.master_addr), env
        )
    except ConfigError as exc:
        return Check(
            "error",
            "network",
            f"{env.node_name}: {listed}; {exc}".split(" HINT:")[0],
            "set train.socket_ifname to an interface every node has, or '' to choose automatically",
        )
    return Check(
        "ok",
        "network",
        f"{env.node_name}: {listed}; NCCL and gloo use "
        f"{choice.name or 'their own choice'} ({choice.why})",
    )


def across_nodes(
    cfg: RunConfig, env: DistEnv, folder: Path, network: Check, collective: Sequence[float] | None
) -> list[Check]:
    """Rank 0 writes a token; the first rank on every node must find it (a real cross-node check).
    Each node's first rank also reports its network, over the interface it names (an unusable one
    fails here). With `collective`, on each rank's own device (GPUs: NCCL), the bandwidth between
    the nodes."""
    import torch

    from ..runtime import distributed

    ifname = cfg.train.socket_ifname if network.level == "ok" else ""
    device = distributed.pick_device(env, cfg.train.device) if collective else torch.device("cpu")
    with distributed.process_group(env, device, 120, 120, ifname):
        name = distributed.broadcast_from_main(f".qgtrain-doctor-{uuid.uuid4().hex[:8]}")
        token = folder / name
        if env.is_main:
            token.write_text("ok")
        distributed.barrier()
        seen = token.exists() if env.local_rank == 0 else True
        # a Check crosses as its fields: ranks send each other no class (runtime/objects.py)
        gathered = distributed.gather_to_main(
            (env.node_name, seen, dataclasses.astuple(network) if env.local_rank == 0 else None)
        )
        distributed.barrier()
        if env.is_main:
            token.unlink(missing_ok=True)
        measured = _collective(env, device, collective) if collective else []
    blind = sorted({node for node, ok, _ in gathered or [] if not ok})
    networks = [Check(*check) for _, _, check in gathered or [] if check is not None]
    if blind:
        return [
            Check(
                "error",
                "shared filesystem",
                f"node(s) {', '.join(blind)} cannot see {folder}",
                "put logging.runs_dir (and data.cache_dir) on a filesystem every node mounts",
            ),
            *networks,
            *measured,
        ]
    return [
        Check("ok", "shared filesystem", f"all {env.num_nodes} node(s) see {folder}"),
        *networks,
        *measured,
    ]


def _collective(env: DistEnv, device: Any, sizes: Sequence[float]) -> list[Check]:
    """The bandwidth checks (a collective); a rank that never answers is named from the rendezvous
    store."""
    import torch.distributed as dist

    from ..foundation.errors import first_line
    from ..runtime.diagnose import missing_ranks
    from . import collective

    try:
        result = collective.measure(env, device, sizes)
    except (RuntimeError, dist.DistError) as exc:
        verdict = collective.judge(
            [], {}, [f"rank {r}" for r in missing_ranks(env) or []] or ["a rank"]
        )
        return [
            Check(
                verdict.level, "collective", f"{verdict.message} ({first_line(exc)})", verdict.fix
            )
        ]
    if result is None:
        return []
    whole, links = collective.render(result, env.world_size)
    verdict = collective.judge(result["nodes"], result["links"])
    return [
        Check("ok", "collective", whole),
        Check("ok", "node links", links),
        Check(verdict.level, "slow nodes", verdict.message, verdict.fix),
    ]
