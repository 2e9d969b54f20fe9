"""What the communication libraries are told: the network interface NCCL and gloo use, and where
NCCL's Flight Recorder leaves its evidence. They read these settings from the process environment
and nowhere else, so this is the one module that writes it (`apply`).

The interface: train.socket_ifname names one; '' means the interface whose address the kernel would
use to reach MASTER_ADDR from this node, unless the job already set NCCL_SOCKET_IFNAME or
GLOO_SOCKET_IFNAME (kept). Choosing is a plain function of an interface table; reading the machine's
interfaces and asking the kernel for a route are thin edges.

The Flight Recorder keeps the last collectives of every NCCL group in a ring buffer (its size is
read when the first NCCL group is made) and, when a collective times out, dumps it to
TORCH_FR_DUMP_TEMP_FILE<rank>, a name read at the first dump: so the buffer is set before the
process group, the place once the run directory is known. `torchfrtrace <folder>` says which rank
stopped where.

A collective that times out or breaks on NCCL never raises in Python: ProcessGroupNCCL's watchdog
thread rethrows the error in itself, which ends the process with SIGABRT (exit 134) after the dump.
How it gets there is TORCH_NCCL_ASYNC_ERROR_HANDLING, read when each NCCL group is made; torchrun's
agent sets it to 1 for its workers when unset (elastic/agent/server/local_elastic_agent.py), srun
sets nothing, so without a choice here the two launchers would differ. qgtrain sets 3 (abort the
process, skip the communicators' cleanup): a new attempt is always a new process (train.slurm's next
srun step), which frees every communicator anyway, while 1 first runs ncclCommAbort, which can
itself hang on a broken fabric until the heartbeat monitor (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, 8
minutes by default) aborts the process all the same. 0 and 2 never end the process: the main thread
would wait forever on a kernel that never finishes, or go on with garbage. `qgtrain recover`
recognises the abort (launch/aborts.py).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..foundation.errors import ConfigError
from .rendezvous import DistEnv

SOCKET_VARS = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
ABORT_AT_ONCE = "3"  # torch's SkipCleanUp: see the module's docstring
_SAME = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "TORCH_FR_BUFFER_SIZE",
    "TORCH_FR_DUMP_TEMP_FILE": "TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
}  # torch reads either name
_SIOCGIFFLAGS, _SIOCGIFADDR, _IFF_UP = 0x8913, 0x8915, 0x1

log = logging.getLogger("qgtrain")
_dumps: list[str] = []  # where this process's Flight Recorder dumps go, once known


@dataclass(frozen=True)
class Interface:
    name: str
    address: str | None  # its IPv4 address
    up: bool = True


@dataclass(frozen=True)
class InterfaceChoice:
    name: str | None  # None: the libraries choose, or the job's own setting stands
    why: str
    configured: bool = False  # named by train.socket_ifname: wins over the job's own setting


def choose_interface(
    configured: str, interfaces: list[Interface], route_source: str | None, env: DistEnv
) -> InterfaceChoice:
    """The interface for NCCL and gloo on this node. `route_source` is the local address the kernel
    would use to reach MASTER_ADDR; `configured` is train.socket_ifname."""
    names = [i.name for i in interfaces]
    if configured:
        if configured not in names:
            raise ConfigError(
                f"train.socket_ifname: {configured!r} is not a network interface of "
                f"{env.node_name} (it has {', '.join(names) or 'none'}). HINT: name one that every "
                f"node has and that reaches {env.master_addr} (`srun qgtrain doctor` lists each "
                "node's), or '' to choose automatically"
            )
        return InterfaceChoice(configured, "train.socket_ifname", configured=True)
    preset = dict(env.comm_env)
    if all(preset.get(name) for name in SOCKET_VARS):
        return InterfaceChoice(
            None, ", ".join(f"{n}={preset[n]}" for n in SOCKET_VARS) + " from the environment"
        )
    if env.world_size == 1:
        return InterfaceChoice(None, "one process: no network")
    holder = next(
        (i for i in interfaces if route_source is not None and i.address == route_source), None
    )
    if holder is None:
        return InterfaceChoice(
            None,
            f"no interface of {env.node_name} holds the address that routes to "
            f"MASTER_ADDR {env.master_addr} ({route_source or 'no route'}): NCCL and gloo "
            "choose their own",
        )
    if holder.address is not None and holder.address.startswith("127.") and env.num_nodes > 1:
        return InterfaceChoice(
            None,
            f"MASTER_ADDR {env.master_addr} resolves to a loopback address on "
            f"{env.node_name}, which other nodes cannot reach: NCCL and gloo choose their "
            "own (set train.socket_ifname to the interface between the nodes)",
        )
    return InterfaceChoice(
        holder.name, f"its address {holder.address} routes to MASTER_ADDR {env.master_addr}"
    )


def socket_settings(choice: InterfaceChoice, env: DistEnv) -> dict[str, str]:
    """NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME for the choice; one the job set itself stays unless
    train.socket_ifname names another."""
    if choice.name is None:
        return {}
    preset = dict(env.comm_env)
    return {name: choice.name for name in SOCKET_VARS if choice.configured or not preset.get(name)}


def recorder_settings(env: DistEnv) -> dict[str, str]:
    """The Flight Recorder's buffer and dump-on-timeout, unless the job set them."""
    preset = dict(env.comm_env)
    return {k: v for k, v in RECORDER.items() if k not in preset and _SAME.get(k) not in preset}


def error_handling(env: DistEnv) -> tuple[dict[str, str], str]:
    """TORCH_NCCL_ASYNC_ERROR_HANDLING, unless the job (or torchrun's agent) set it. Returns the
    settings and the value NCCL's groups will run with."""
    given = dict(env.comm_env).get(ERROR_HANDLING)
    return ({}, given) if given else ({ERROR_HANDLING: ABORT_AT_ONCE}, ABORT_AT_ONCE)


def dump_settings(prefix: Path, env: DistEnv) -> tuple[dict[str, str], str]:
    """Where a timed-out NCCL collective's Flight Recorder dump goes: `prefix`<rank> (in the run
    directory), unless the job named a place. Returns the settings and the place."""
    preset = dict(env.comm_env)
    given = preset.get("TORCH_FR_DUMP_TEMP_FILE") or preset.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if given:
        return {}, given
    return {"TORCH_FR_DUMP_TEMP_FILE": str(prefix)}, str(prefix)


def apply(settings: Mapping[str, str]) -> None:
    """Set variables the libraries read (qgtrain reads the environment only through
    rendezvous.py)."""
    os.environ.update(settings)


def configure_network(env: DistEnv, nccl: bool, socket_ifname: str) -> InterfaceChoice:
    """Before the process group: the interface (and on NCCL the Flight Recorder's buffer and what a
    failed collective does), set and logged."""
    choice = choose_interface(
        socket_ifname, machine_interfaces(), route_source(env.master_addr), env
    )
    settings = socket_settings(choice, env)
    handling, value = error_handling(env)
    apply({**settings, **({**recorder_settings(env), **handling} if nccl else {})})
    if env.world_size > 1 or settings:
        log.info(
            "network interface %s (%s)%s",
            choice.name or "chosen by the libraries",
            choice.why,
            f": {', '.join(f'{k}={v}' for k, v in settings.items())}" if settings else "",
        )
    if nccl:
        log.info("NCCL: %s", on_failed_collective(value, own=not handling))
    return choice


def on_failed_collective(value: str, own: bool) -> str:
    """What a collective that times out or breaks does to this process, for the log."""
    source = f"{ERROR_HANDLING}={value}" + (" from the environment" if own else "")
    if value.strip() in ("1", "3"):
        return (
            "a collective that times out or breaks ends this process with SIGABRT (exit 134) "
            f"({source})"
        )
    return (
        f"a collective that times out or breaks does not end this process ({source}): it may "
        f"wait until the job's time limit; unset it, or set {ABORT_AT_ONCE}"
    )


def keep_nccl_dumps(prefix: Path, env: DistEnv, device_type: str) -> None:
    """Once the run directory is known, on a GPU: a timed-out NCCL collective dumps into it."""
    if device_type != "cuda":
        return
    settings, where = dump_settings(prefix, env)
    Path(where).parent.mkdir(parents=True, exist_ok=True)
    apply(settings)
    _dumps[:] = [where]
    log.info(
        "NCCL Flight Recorder: a collective that times out dumps every group's last collectives to "
        "%s<rank> (`torchfrtrace %s` reads them)",
        where,
        Path(where).parent,
    )


def nccl_dumps() -> str | None:
    """Where this process's Flight Recorder dumps go, if NCCL runs here."""
    return _dumps[0] if _dumps else None


def machine_interfaces() -> list[Interface]:
    """This node's network interfaces with their IPv4 addresses (Linux ioctls; no extra
    dependency)."""
    found = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                address: str | None = socket.inet_ntoa(
                    fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)[20:24]
                )
            except OSError:  # no IPv4 address
                address = None
            try:
                up = bool(
                    struct.unpack("H", fcntl.ioctl(sock.fileno(), _SIOCGIFFLAGS, request)[16:18])[0]
                    & _IFF_UP
                )
            except OSError:
                up = False
            found.append(Interface(name, address, up))
    return found


def route_source(host: str) -> str | None:
    """The local address the kernel would use to reach `host` (connecting a UDP socket sends
    nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((socket.gethostbyname(host), 9))
            return str(sock.getsockname()[0])
    except OSError:
        return None
