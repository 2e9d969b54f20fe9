"""Which device a rank trains on: a plain function of the rendezvous, CUDA_VISIBLE_DEVICES and how
many GPUs the process can see. No torch here, so `qgtrain env` answers the same question on any
machine.

Slurm shows a task its GPUs through CUDA_VISIBLE_DEVICES. Bound one per task (--gpus-per-task=1,
--gpu-bind=single:1 or closest) a task sees exactly one, index 0 inside the task, whatever its local
rank; with --gpus-per-node=N and no binding every task sees all N and takes the one at its local
rank. Anything in between (more than one GPU, fewer than the node's ranks) cannot be shared out
without guessing, so it is refused with the options that fix it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..foundation.errors import RendezvousError
from .rendezvous import DistEnv

SLURM_BINDING = (
    "srun --gpus-per-task=1 (or --gpu-bind=single:1 / closest) gives each task its own GPU; "
    "--gpus-per-node=N with --ntasks-per-node=N shows every task all N"
)


@dataclass(frozen=True)
class DeviceChoice:
    type: Literal["cpu", "cuda"]
    index: int | None
    why: str

    @property
    def name(self) -> str:
        return f"cuda:{self.index}" if self.type == "cuda" else "cpu"


def visible_entries(cuda_visible_devices: str | None) -> list[str] | None:
    """The GPUs CUDA_VISIBLE_DEVICES shows, as CUDA reads it: indices or GPU-/MIG- UUIDs up to the
    first entry that is neither ('' and Slurm's NoDevFiles show none). None: unset, every GPU
    shows."""
    if cuda_visible_devices is None:
        return None
    entries = []
    for entry in cuda_visible_devices.split(","):
        entry = entry.strip()
        if not re.fullmatch(r"\d+|GPU-[0-9A-Fa-f-]+|MIG-[\w/-]+", entry):
            break
        entries.append(entry)
    return entries


def gpu_device_files(dev: Path = Path("/dev")) -> int:
    """The node's NVIDIA GPUs by their device files (/dev/nvidia0, ...): `qgtrain env`'s count where
    CUDA_VISIBLE_DEVICES is unset and CUDA is not asked."""
    try:
        return sum(1 for path in dev.iterdir() if re.fullmatch(r"nvidia\d+", path.name))
    except OSError:
        return 0


def count_without_cuda(env: DistEnv, dev: Path = Path("/dev")) -> int:
    """How many GPUs this process would see, from the environment and the device files alone."""
    entries = visible_entries(env.cuda_visible_devices)
    return gpu_device_files(dev) if entries is None else len(entries)


def choose(preference: str, env: DistEnv, count: int) -> DeviceChoice:
    """The rank's device for train.device `preference` (auto, cpu, cuda), given `count` visible
    GPUs."""
    shown = _shown(env)
    if preference == "cpu":
        return DeviceChoice("cpu", None, "train.device is cpu")
    if count == 0:
        if preference == "cuda":
            raise RendezvousError(
                f"train.device is 'cuda' but no GPU is visible to rank {env.rank} on "
                f"{env.node_name} ({shown}). HINT: request GPUs (--gpus-per-node or "
                "--gpus-per-task) or set train.device: cpu"
            )
        return DeviceChoice("cpu", None, f"no GPU is visible ({shown})")
    if count == 1:
        return DeviceChoice(
            "cuda", 0, f"one GPU is visible to this task ({shown}): it is this rank's"
        )
    if count >= env.local_world_size:
        return DeviceChoice(
            "cuda",
            env.local_rank,
            f"{count} GPUs are visible to the {env.local_world_size} "
            f"rank(s) on {env.node_name} ({shown}): local rank {env.local_rank} takes GPU "
            f"{env.local_rank}",
        )
    raise RendezvousError(
        f"{count} GPUs are visible to each of the {env.local_world_size} ranks on {env.node_name} "
        f"({shown}): more than one, but fewer than the ranks, so local rank {env.local_rank} has "
        f"no GPU of its own. HINT: {SLURM_BINDING}; or run {count} rank(s) per node "
        f"(--ntasks-per-node={count})"
    )


def report(env: DistEnv, preference: str, dev: Path = Path("/dev")) -> str:
    """`qgtrain env`'s JSON: the rendezvous, and the device with why, from the environment and
    device files."""
    choice = choose(preference, env, count_without_cuda(env, dev))
    return json.dumps(
        {
            **env.describe(),
            "device": choice.name,
            "device_index": choice.index,
            "device_why": choice.why,
        },
        indent=1,
    )


def _shown(env: DistEnv) -> str:
    if env.cuda_visible_devices is None:
        return "CUDA_VISIBLE_DEVICES is unset"
    return f"CUDA_VISIBLE_DEVICES={env.cuda_visible_devices!r}"


def shared_gpu(claims: list[tuple[str, str, str]]) -> str | None:
    """Why the ranks cannot start, if two of them would drive one GPU: each rank's (node, device,
    GPU UUID) in rank order, as the ranks tell each other before NCCL's join. NCCL refuses it with
    "Duplicate GPU detected", which qgtrain would otherwise report as a network join failure."""
    by_gpu: dict[str, list[int]] = {}
    for rank, (_, _, uuid) in enumerate(claims):
        by_gpu.setdefault(uuid, []).append(rank)
    shared = next((ranks for ranks in by_gpu.values() if len(ranks) > 1), None)
    if shared is None:
        return None
    node, device, uuid = claims[shared[0]]
    return (
        f"ranks {shared} on {node} would all drive one GPU ({device}, {uuid}), and NCCL runs "
        "one rank per GPU. HINT: start as many tasks per node as the node has GPUs "
        f"({SLURM_BINDING}); under torchrun, --nproc_per_node equal to the GPUs it sees; a "
        "CUDA_VISIBLE_DEVICES set by hand must differ between the node's ranks"
    )
