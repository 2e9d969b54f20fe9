"""How a rank joins a multi-rank process group: the others wait for rank 0's store to listen,
no two ranks may drive one GPU, and the group is bound to the rank's GPU; and what a failed join
says about the network it tried. distributed.process_group is the one caller.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from ..foundation.errors import RendezvousError
from . import comms, devices, once, store
from .rendezvous import DistEnv


def join(env: DistEnv, backend: str, timeout: datetime.timedelta, device: torch.device) -> None:
    """Rank 0 hosts the store on MASTER_ADDR's address where it can (store.py); the others are its
    clients. On GPUs the ranks first make sure no two drive one GPU, then bind the group to the
    rank's GPU (device_id): NCCL forms its communicator at once, and every later group of a subset
    (hsdp's mesh, the doctor's pairs) splits from it (ncclCommSplit) instead of paying a full NCCL
    init (torch/distributed/distributed_c10d.py init_process_group's device_id,
    _new_process_group_helper's split_from)."""
    job_store = store.job_store(env, timeout)
    if device.type == "cuda":
        refuse_shared_gpus(job_store, env, gpu_claim(env, device))
    dist.init_process_group(
        backend,
        store=job_store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )


def gpu_claim(env: DistEnv, device: torch.device) -> str:
    """Which GPU this rank drives, by the card's UUID: two ranks may name different devices (their
    own CUDA_VISIBLE_DEVICES) and still drive one card."""
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return json.dumps([env.node_name, str(device), uuid])


def refuse_shared_gpus(job_store: Any, env: DistEnv, claim: str) -> None:
    """Every rank tells the others its GPU claim through the store (no process group yet: NCCL would
    hang or fail obscurely on a shared card) and all refuse together, naming the ranks."""
    claims = [json.loads(each) for each in store.exchange(job_store, "gpu", claim, env)]
    if (why := devices.shared_gpu([tuple(each) for each in claims])) is not None:
        raise RendezvousError(why)


def network_hint(env: DistEnv, network: comms.InterfaceChoice, nccl: bool) -> str:
    used = (
        f"{'NCCL and gloo' if nccl else 'gloo'} used "
        f"{network.name or 'interfaces of their own choosing'} ({network.why}); "
    )
    debug = ", and NCCL_DEBUG=INFO shows what NCCL tried" if nccl else ""
    return (
        f"{used}if that does not reach {env.master_addr}, set train.socket_ifname to one that does "
        f"(`srun qgtrain doctor` lists each node's interfaces){debug}. "
    )


def wait_for_listener(host: str, port: int, deadline: float) -> None:
    """Return once rank 0's store accepts connections (or at the deadline, leaving the error to the
    join).

    A rank that reaches the store before rank 0 has opened it is refused, and torch's client then
    backs off for about half a second, longer on each retry: many starts paid that, as every rank
    imports the same modules at nearly the same moment. Probing with a plain connect every few
    milliseconds costs the store one closed connection per rank.
    """
    for pause in once.pauses(0.005, 0.1):
        if time.monotonic() >= deadline:
            return
        try:
            socket.create_connection(
                (host, port), timeout=max(0.01, min(1.0, deadline - time.monotonic()))
            ).close()
            return
        except OSError:
            time.sleep(pause)
