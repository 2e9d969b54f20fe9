"""Rank 0's rendezvous store, listening on the address of MASTER_ADDR only.

torch's tcp:// rendezvous makes rank 0's TCPStore listen on every interface (`::`), so a node's
other networks (a login network, a public address) reach a store that takes any key from anyone.
TCPStore can instead take over a socket bound by its caller (master_listen_fd), so rank 0 binds
MASTER_ADDR's address and port and hands the socket over. Where that address is not this host's
(a master behind NAT), names several addresses, or is a loopback address other nodes cannot
reach, rank 0 listens on every address, as TCPStore does by itself, and says why: a job must still
start. The other ranks are clients either way. Every rank builds its store itself, as torch's tcp://
rendezvous would (torch/distributed/rendezvous.py _create_c10d_store), so the ranks can exchange
what must be known before the process group exists (which GPU each drives) and hand the store to
init_process_group.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import socket
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.rendezvous as torch_rendezvous

from .rendezvous import DistEnv

log = logging.getLogger("qgtrain")


def job_store(env: DistEnv, timeout: datetime.timedelta) -> Any:
    """This rank's handle on the job's store, keyed as torch's tcp:// rendezvous keys it (a
    "default_pg" prefix): rank 0 hosts it, the others are its clients."""
    if env.is_main:
        store = _master_store(env, timeout)
    else:
        store = dist.TCPStore(  # type: ignore[attr-defined]
            env.master_addr, env.master_port, env.world_size, False, timeout
        )
    store.set_timeout(timeout)
    return dist.PrefixStore("default_pg", store)  # type: ignore[attr-defined]


def _master_store(env: DistEnv, timeout: datetime.timedelta) -> Any:
    """Bound to MASTER_ADDR where it can be, else listening everywhere (multi_tenant, as torch's
    own)."""
    listener, why = bound_listener(env.master_addr, env.master_port, env.num_nodes)
    if listener is None:
        log.info("rendezvous store: listens on every interface of %s, as %s", env.node_name, why)
        return dist.TCPStore(  # type: ignore[attr-defined]
            env.master_addr, env.master_port, env.world_size, True, timeout, multi_tenant=True
        )
    log.info("rendezvous store: %s", why)
    return dist.TCPStore(  # type: ignore[attr-defined]
        env.master_addr,
        env.master_port,
        env.world_size,
        True,
        timeout,
        master_listen_fd=listener.detach(),
        use_libuv=_libuv_takes_fd(),
    )


def exchange(store: Any, name: str, mine: str, env: DistEnv) -> list[str]:
    """Every rank's string for `name`, in rank order: each sets its own key and reads the others'
    (waiting up to the store's timeout). Strings, never pickles: store.py binds, but does not guard.

    Rank 0 hosts the store, so it returns only once every rank has read: a rank 0 that went on to
    fail (a refusal every rank reaches from the same strings) would otherwise take the store down
    under a slower rank still reading, which would then fail with a lost connection instead."""
    store.set(f"qgtrain/{name}/{env.rank}", mine)
    keys = [f"qgtrain/{name}/{rank}" for rank in range(env.world_size)]
    store.wait(keys)
    seen = [store.get(key).decode() for key in keys]
    if store.add(f"qgtrain/{name}/read", 1) == env.world_size:
        store.set(f"qgtrain/{name}/all-read", "1")
    if env.rank == 0:
        store.wait([f"qgtrain/{name}/all-read"])
    return seen


def bound_listener(host: str, port: int, num_nodes: int) -> tuple[socket.socket | None, str]:
    """A socket listening on `host`'s one address and `port`, or None and why not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return None, f"MASTER_ADDR {host} does not resolve here ({exc})"
    found = {(info[0], str(info[4][0])) for info in infos}
    if len(found) != 1:
        listed = ", ".join(sorted(address for _, address in found))
        return None, f"MASTER_ADDR {host} resolves to {len(found)} addresses ({listed})"
    family, address = found.pop()
    if ipaddress.ip_address(address.split("%")[0]).is_loopback and num_nodes > 1:
        return (
            None,
            f"MASTER_ADDR {host} is the loopback address {address}, which other nodes cannot reach",
        )
    listener = socket.socket(family, socket.SOCK_STREAM)  # not inherited by children (PEP 446)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own listener
        listener.bind((address, port))
        listener.listen()
    except OSError as exc:
        listener.close()
        return None, f"MASTER_ADDR {host} ({address}) port {port} cannot be bound: {exc.strerror}"
    return listener, f"listens on {address} port {port} only (MASTER_ADDR {host})"


def _libuv_takes_fd() -> bool:
    """torch's libuv store takes a listening socket from 2.8 (pytorch#150215), refusing one before;
    the older backend always took one. Where both can, torch's own choice (USE_LIBUV) stands."""
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 8):
        return False
    choose = getattr(torch_rendezvous, "_get_use_libuv_from_query_dict", None)
    return bool(choose({})) if choose is not None else True
