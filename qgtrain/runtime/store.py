"""Rank 0's rendezvous store, listening on the address of MASTER_ADDR only.

torch's tcp:// rendezvous makes rank 0's TCPStore listen on every interface (`::`), so a node's
other networks (a login network, a public address) reach a store that takes any key from anyone.
TCPStore can instead take over a socket bound by its caller (master_listen_fd), so rank 0 binds
MASTER_ADDR's address and port and hands the socket over. Where that address is not this host's
(a master behind NAT), names several addresses, or is a loopback address other nodes cannot
reach, rank 0 listens everywhere as before and says why: a job must still start. The other ranks
are clients either way and join through torch's tcp:// rendezvous, unchanged.
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


def master_store(env: DistEnv, timeout: datetime.timedelta) -> Any:
    """Rank 0's store bound to MASTER_ADDR, keyed as torch's tcp:// rendezvous keys it (a
    "default_pg" prefix); None where it cannot be bound, for the caller to listen everywhere."""
    listener, why = bound_listener(env.master_addr, env.master_port, env.num_nodes)
    if listener is None:
        log.info("rendezvous store: listens on every interface of %s, as %s", env.node_name, why)
        return None
    store = dist.TCPStore(  # type: ignore[attr-defined]
        env.master_addr, env.master_port, env.world_size, True, timeout,
        master_listen_fd=listener.detach(), use_libuv=_libuv_takes_fd())
    log.info("rendezvous store: %s", why)
    store.set_timeout(timeout)
    return dist.PrefixStore("default_pg", store)  # type: ignore[attr-defined]


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
        return None, f"MASTER_ADDR {host} is the loopback address {address}, which other nodes " \
                     "cannot reach"
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
