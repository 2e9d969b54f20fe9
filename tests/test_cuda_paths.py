"""What the CUDA paths do, where a CPU can see it. Runs against: real 2-rank gloo groups, holding
shards (DTensors) whose mesh says "cuda" while their data lies in host memory (torch builds such a
mesh without a GPU when it is not asked to set one up), written and read back by
torch.distributed.checkpoint."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.ranks import run_ranks


def snapshot_of_a_gpu_shard(folder: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from qgtrain.runtime import distributed
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.state import sharded
    from qgtrain.state.host_copy import HostCopy

    env = from_environ(os.environ)
    with distributed.process_group(env, torch.device("cpu"), 60, 60):
        rank = dist.get_rank()
        # where the shards would live
        gpu_mesh = DeviceMesh("cuda", torch.arange(2), _init_backend=False)
        local = torch.arange(4.0) + 4 * rank
        shard = DTensor(
            local,
            DTensorSpec(gpu_mesh, (Shard(0),), TensorMeta(torch.Size([8]), (1,), torch.float32)),
            requires_grad=False,
        )
        moved = None
        try:  # what torch itself does with a host tensor given a GPU mesh
            DTensor.from_local(local, gpu_mesh, [Shard(0)], run_check=False)
        except (RuntimeError, AssertionError) as exc:
            moved = str(exc)
        snapshot = HostCopy()
        copy = snapshot.copy({"model": {"w": shard}})
        again = snapshot.copy({"model": {"w": shard}})["model"]["w"]
        w = copy["model"]["w"]
        sharded.write(Path(folder), copy, rank, dist.new_group(backend="gloo"))
        dist.barrier()
        whole = {"model": {"w": torch.zeros(8)}}
        if rank == 0:
            load(
                whole, storage_reader=FileSystemReader(Path(folder) / sharded.FOLDER), no_dist=True
            )
        return {
            "mesh": w.device_mesh.device_type,
            "local": w.to_local().device.type,
            "values": w.to_local().tolist(),
            "own_buffer": w.to_local().data_ptr() != local.data_ptr(),
            "shape": list(w.shape),
            "same_mesh_again": again.device_mesh is w.device_mesh,
            "torch_moves": moved,
            "whole": whole["model"]["w"].tolist(),
        }


def test_an_async_snapshot_of_gpu_shards_stays_in_host_memory_and_writes_as_shards(tmp_path):
    ranks = run_ranks(2, snapshot_of_a_gpu_shard, str(tmp_path))
    for rank, seen in enumerate(ranks):
        assert seen["torch_moves"], (
            "DTensor.from_local moves a host tensor to its mesh's device (no CUDA here)"
        )
        assert (seen["mesh"], seen["local"], seen["shape"]) == ("cpu", "cpu", [8])
        assert (
            seen["values"] == [float(v) for v in range(4 * rank, 4 * rank + 4)]
            and seen["own_buffer"]
        )
        assert seen["same_mesh_again"], "the CPU twin of a mesh is made once"
    assert ranks[0]["whole"] == [float(v) for v in range(8)], (
        "DCP wrote each rank's part at its place"
    )


@pytest.fixture(autouse=True)
def _no_cuda_here() -> None:
    if torch.cuda.is_available():
        pytest.skip(
            "these stand-ins are for machines without CUDA; "
            "python -m bench.gpu_check runs the real paths"
        )


def cpu_twin_of_an_hsdp_mesh() -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    from qgtrain.runtime import distributed
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.state.host_copy import HostCopy

    env = from_environ(os.environ)
    with distributed.process_group(env, torch.device("cpu"), 60, 60):
        rank = dist.get_rank()
        gpu_mesh = DeviceMesh(
            "cuda",
            torch.arange(4).reshape(2, 2),
            mesh_dim_names=("replicate", "shard"),
            _init_backend=False,
        )
        local = torch.arange(2.0) + 2 * (rank % 2)
        spec = DTensorSpec(
            gpu_mesh, (Replicate(), Shard(0)), TensorMeta(torch.Size([4]), (1,), torch.float32)
        )
        twin = HostCopy(timeout_s=7).copy({"w": DTensor(local, spec, requires_grad=False)})["w"]
        groups = [twin.device_mesh.get_group(name) for name in ("replicate", "shard")]
        return {
            "mesh": twin.device_mesh.device_type,
            "shape": list(twin.device_mesh.mesh.shape),
            "timeouts": [
                g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups
            ],
            "values": twin.to_local().tolist(),
        }


def test_the_cpu_twin_of_an_hsdp_mesh_has_groups_bounded_by_the_collective_timeout():
    """A 2-D mesh's twin makes groups of its own; made by DeviceMesh they would wait half an hour
    for a rank cut off mid-save (4 real gloo ranks)."""
    for rank, seen in enumerate(run_ranks(4, cpu_twin_of_an_hsdp_mesh)):
        assert (seen["mesh"], seen["shape"], seen["timeouts"]) == ("cpu", [2, 2], [7.0, 7.0])
        assert seen["values"] == [float(v) for v in range(2 * (rank % 2), 2 * (rank % 2) + 2)]
