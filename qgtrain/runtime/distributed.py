"""The process group: started from a DistEnv, destroyed on every exit path, and the few collectives
we use.

One process is a world of size 1 with an in-memory store, so the trainer takes the same collective
path for 1 and N ranks. Every helper here is a collective: all ranks must call it, in the same
order.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import logging
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..foundation.errors import JoinError, QgtrainError, first_line
from . import comms, devices, joining, objects, wire
from .once import main_works_long as main_works_long  # where callers have always found it
from .rendezvous import DistEnv


def pick_device(env: DistEnv, preference: str, cuda: Any = torch.cuda) -> torch.device:
    """The rank's device (devices.choose: never the global rank), made this process's current CUDA
    device before the process group or anything else touches CUDA. FSDP places shards, DTensor moves
    tensors, NCCL binds its communicator, the DataLoader pins and bf16 is probed on the current
    device, which is GPU 0 until set. `cuda` is torch.cuda; a test passes a recorder."""
    count = cuda.device_count() if preference != "cpu" and cuda.is_available() else 0
    choice = devices.choose(preference, env, count)
    logging.getLogger("qgtrain").info("device %s: %s", choice.name, choice.why)
    if choice.index is None:
        return torch.device("cpu")
    cuda.set_device(choice.index)
    return torch.device("cuda", choice.index)


def ddp_device_ids(device: torch.device) -> list[int] | None:
    """DDP's device_ids: the rank's GPU as an int (never a torch.device, never the global rank);
    none on CPU."""
    return [device.index] if device.type == "cuda" and device.index is not None else None


@contextlib.contextmanager
def process_group(
    env: DistEnv,
    device: torch.device,
    startup_timeout_s: float,
    collective_timeout_s: float,
    socket_ifname: str = "",
) -> Iterator[None]:
    """Join the job's process group; leave it however the body exits. The first collective runs
    here, on the rank's device: NCCL makes its communicator only then, so a network it cannot use
    fails inside this rendezvous handling, with the interface it was given, instead of at some later
    step."""
    nccl = device.type == "cuda"
    backend = "cpu:gloo,cuda:nccl" if nccl else "gloo"
    network = comms.configure_network(env, nccl, socket_ifname)
    try:
        if env.world_size == 1:
            dist.init_process_group(
                backend,
                store=dist.HashStore(),  # type: ignore[attr-defined]
                rank=0,
                world_size=1,
                timeout=datetime.timedelta(seconds=collective_timeout_s),
            )
        else:
            if not env.is_main:
                joining.wait_for_listener(
                    env.master_addr, env.master_port, time.monotonic() + startup_timeout_s
                )
            joining.join(env, backend, datetime.timedelta(seconds=startup_timeout_s), device)
            joined = torch.ones(1, device=device)
            dist.all_reduce(joined)  # every rank has joined, over NCCL too on a GPU
            joined.item()  # and the collective has finished, not only started
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=collective_timeout_s))
    except (RuntimeError, dist.DistError) as exc:
        _destroy()
        raise JoinError(
            f"rank {env.rank} could not join {env.world_size} ranks at "
            f"{env.master_addr}:{env.master_port} within {startup_timeout_s:.0f}s "
            f"({first_line(exc)}). HINT: were all tasks started together by srun (train.slurm) or "
            "torchrun? Is the port free and the master host reachable from every node? "
            f"{joining.network_hint(env, network, nccl)}`qgtrain env` inside srun prints what each "
            "rank sees"
        ) from None
    try:
        yield
    finally:
        _release_users()
        _destroy()


def process_group_for(
    env: DistEnv, device: torch.device, train: TrainConfig
) -> contextlib.AbstractContextManager[None]:
    """`process_group` from the train section: its timeouts and network interface."""
    return process_group(
        env, device, train.startup_timeout_s, train.collective_timeout_s, train.socket_ifname
    )


def _release_users() -> None:
    """Free what holds the group (DDP's reducer) while the group is still registered.

    A reducer that outlives the group destroys it from its own deallocator, which joins gloo's
    worker threads with the GIL held; a worker still finishing a collective needs the GIL to free
    its tensors, and the rank hangs forever. The frames of an exception on its way out keep the
    model alive, so they are cleared first (the traceback still prints), then cycles are collected.
    """
    error = sys.exc_info()[1]
    if error is not None:
        traceback.clear_frames(error.__traceback__)
    gc.collect()


def _destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def collectives_wait(seconds: float, then: float) -> Iterator[None]:
    """Collectives started inside wait up to `seconds`, and `then` after: for the start, where one
    rank legitimately works far longer than the others (rank 0 reading a 70B model from a shared
    filesystem while the rest build theirs empty) and only train.startup_timeout_s should cut the
    wait short. A peer that is gone still fails the collective at once (its connection closes). The
    timeout is the group's (distributed_c10d._set_pg_timeout, as the join sets
    train.collective_timeout_s); one process has nothing to wait for."""
    if dist.get_world_size() == 1:
        yield
        return
    dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=seconds))
    try:
        yield
    finally:
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=then))


def barrier() -> None:
    dist.barrier()


def any_flags(flags: Sequence[bool | int | torch.Tensor], device: torch.device) -> list[bool]:
    """Each flag is true on every rank if it is true on any rank: the stop decisions all ranks must
    share."""
    tensor = torch.tensor([int(bool(f)) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]


def any_flags_later(flags: torch.Tensor) -> Callable[[], torch.Tensor]:
    """any_flags on an int32 device tensor, started now and finished by the returned call, which
    gives the agreed flags as a device tensor (no host sync): the all-reduce runs while the caller
    computes (a step's forward and backward), so agreeing costs no round trip on the step's path.
    One process starts none."""
    work = (
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        if dist.get_world_size() > 1
        else None
    )

    def finish() -> torch.Tensor:
        if work is not None:
            work.wait()
        return flags

    return finish


def flagged_ranks(flag: bool, device: torch.device) -> list[int]:
    """The ranks on which `flag` is true, known to every rank (for error messages)."""
    tensor = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    tensor[dist.get_rank()] = int(flag)
    dist.all_reduce(tensor)
    return [rank for rank, value in enumerate(tensor.tolist()) if value]


def sum_tensors(values: torch.Tensor) -> list[float]:
    """Sum a float64 device tensor over ranks and read it on the host: one collective, one sync
    (losses and counts, each sample counted once)."""
    dist.all_reduce(values)
    return values.tolist()


def diverged(named: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> list[str]:
    """Names of the tensors whose replicas differ between ranks, by a float64 sum per tensor (one
    pass over memory, two small all-reduces): the same on every rank."""
    if not named:
        return []
    sums = torch.stack(
        [
            t.detach().double().sum().nan_to_num(nan=0.0, posinf=1e308, neginf=-1e308).to(device)
            for _, t in named
        ]
    )
    high, low = sums.clone(), sums.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return [name for (name, _), differs in zip(named, (high != low).tolist()) if differs]


def broadcast_from_main(obj: Any) -> Any:
    """Rank 0's small value on every rank, as data (objects.py: tensors, numbers, strings and
    containers of them, never a pickle)."""
    return objects.broadcast(obj, what="decision")


def gather_to_main(obj: Any, group: dist.ProcessGroup | None = None) -> list[Any] | None:
    """Every rank's small value, as a list on rank 0 (None elsewhere), as data (objects.py)."""
    return objects.gather(obj, group, "report")


def attempt(work: Callable[[], Any]) -> tuple[Any, str | None]:
    """work()'s result, or the QgtrainError it raised encoded by name and message (wire.py) to cross
    to the other ranks: never as a class."""
    try:
        return work(), None
    except QgtrainError as exc:
        return None, wire.error(exc)


def fail_together(failure: str | None, what: str) -> None:
    """A collective: the lowest failing rank's error (from `attempt`) is raised on every rank, so no
    rank is left waiting in a later collective for one that has gone."""
    failures = objects.all_gather(failure, what=what)
    for rank, failed in enumerate(failures):
        if failed is not None:
            wire.decode(failed, f"rank {rank}'s {what}")


def main_decides(decide: Callable[[], Any]) -> Any:
    """Run `decide` on rank 0 and return its result on every rank; a QgtrainError it raises is
    raised on every rank. The result travels as data (objects.py): a dataclass crosses as a dict
    or tuple the caller converts, never as a pickle of its class."""
    result, failure = attempt(decide) if dist.get_rank() == 0 else (None, None)
    fail_together(failure, "decision")
    return broadcast_from_main(result)
