"""The host copy an asynchronous save writes from, and its buffers made before the first save needs
them.

Pinning host memory for a large model takes seconds to tens of seconds (page-locking every page).
Done by the first save, on the main thread, the deadline planner counts it as a checkpoint stall. So
at start, once the model and optimizer exist, a background thread allocates and pins a buffer for
every tensor a save will copy from the GPU (`prepare`); the first save takes them (waiting only for
what is not done yet), and later saves reuse them. The optimizer's state does not exist
before its first step: for Adam and AdamW it is predicted as torch makes it (optim/adam.py:
Adam._init_group: exp_avg and exp_avg_sq like the parameter, `step` on the parameter's device when
fused or capturable). On a CPU nothing is pinned, so nothing is prepared.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..runtime.mesh import two_d_mesh
from . import sharded
from .weights import saved_state

log = logging.getLogger("qgtrain")
BufferSpec = tuple[torch.Size, torch.dtype]


def pin(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """A page-locked host buffer, so the device-to-host copy runs at full speed (and
    asynchronously)."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def is_pinned_copy(tensor: torch.Tensor) -> bool:
    """Whether a host copy copies `tensor` into pinned memory: only what lies on a GPU."""
    return tensor.is_cuda


def buffer_specs(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    copies_here: bool,
    pinned: Callable[[torch.Tensor], bool] = is_pinned_copy,
) -> list[BufferSpec]:
    """The buffers to pin for what this rank's saves will copy (`copies_here`: rank 0's replicated
    files, or every rank's shards under FSDP, their local parts), as far as it is known before
    training. One per distinct tensor (tied weights share one); the optimizer's state predicted
    where it is not made yet."""
    if not copies_here:
        return []
    made = [
        *saved_state(model).values(),
        *(v for state in optimizer.state.values() for v in state.values()),
    ]
    seen, found = set(), []
    for tensor in (_local(t) for t in made if isinstance(t, torch.Tensor)):
        if pinned(tensor) and (alias := _alias(tensor)) not in seen:
            seen.add(alias)
            found.append((tensor.shape, tensor.dtype))
    for group in optimizer.param_groups:
        for param in group["params"]:
            local = _local(param)
            if not optimizer.state.get(param) and pinned(local):
                found += _predicted(optimizer, group, local)
    return found


def _predicted(
    optimizer: torch.optim.Optimizer, group: dict[str, Any], param: torch.Tensor
) -> list[BufferSpec]:
    """The state torch's Adam and AdamW make for `param` at their first step; other optimizers' is
    left to the first save."""
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return []
    like = [(param.shape, param.dtype)] * (3 if group.get("amsgrad") else 2)
    on_device = group.get("fused") or group.get("capturable")
    step: list[BufferSpec] = [(torch.Size(()), torch.float32)] if on_device else []
    return like + step


def _local(tensor: torch.Tensor) -> torch.Tensor:
    shard = sharded.shard_of(tensor)
    return shard.to_local() if shard is not None else tensor


def _alias(t: torch.Tensor) -> tuple[Any, ...]:
    return (
        t.device,
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        t.shape,
        t.stride(),
        t.dtype,
    )


class HostCopy:
    """Copies state into CPU buffers kept from the previous save, so an async save's stall is one
    memcpy.

    Fresh buffers would cost as much again in page faults on first touch; for CUDA state they are
    pinned, so the device-to-host copy runs at full speed. Buffers are reused only after the
    previous save has finished (Checkpointer.save waits for it first). Tensors sharing storage (tied
    embeddings) stay shared. A shard (DTensor) is rebuilt around its host copy on a CPU twin of its
    mesh: DTensor.from_local moves the local tensor to its mesh's device, so on the GPU mesh the
    "host copy" would be a second copy of the shards in GPU memory. The price: one host copy of the
    state held for the whole run.
    """

    def __init__(
        self,
        timeout_s: float = 300.0,
        allocate: Callable[[torch.Size, torch.dtype], torch.Tensor] = pin,
        pinned: Callable[[torch.Tensor], bool] = is_pinned_copy,
    ) -> None:
        self.timeout_s = timeout_s  # for the CPU twins' own groups
        self._allocate, self._pinned = allocate, pinned
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        self._cpu_meshes: dict[Any, Any] = {}
        self._prepared: dict[BufferSpec, list[torch.Tensor]] = {}
        self._preparing: threading.Thread | None = None

    def prepare(self, specs: list[BufferSpec]) -> None:
        """Allocate (pin) these buffers in the background; the first copy takes them."""
        if not specs:
            return

        def allocate() -> None:
            try:
                for spec in specs:
                    self._prepared.setdefault(spec, []).append(self._allocate(*spec))
            except BaseException as exc:
                # the first save allocates what is missing, and says what fails
                log.warning("could not pin the async checkpoint's host buffers ahead: %s", exc)

        self._preparing = threading.Thread(target=allocate, name="qgtrain-pin-buffers", daemon=True)
        self._preparing.start()

    def copy(self, obj: Any) -> Any:
        if self._preparing is not None:
            self._preparing.join()  # the first save waits only for what is left
            self._preparing = None
        shared: dict[tuple[Any, ...], torch.Tensor] = {}
        copied = self._copy(obj, (), shared)
        self._prepared.clear()  # a predicted buffer no save used is not kept
        for device in {key[0] for key in shared if key[0].type == "cuda"}:  # the rank's own GPU
            # the non-blocking copies must land before the writer reads them
            torch.cuda.synchronize(device)
        return copied

    def _copy(
        self, obj: Any, path: tuple[Any, ...], shared: dict[tuple[Any, ...], torch.Tensor]
    ) -> Any:
        # copy the local part, keep where it lies in the whole
        if (shard := sharded.shard_of(obj)) is not None:
            local = self._copy(shard.to_local(), path, shared)
            mesh = self._cpu_mesh(shard.device_mesh)
            return type(shard).from_local(
                local,
                mesh,
                shard.placements,
                run_check=False,
                shape=shard.shape,
                stride=shard.stride(),
            )
        if isinstance(obj, torch.Tensor):
            alias = _alias(obj)
            if alias not in shared:
                buffer = self._buffers.get(path)
                if buffer is None or buffer.shape != obj.shape or buffer.dtype != obj.dtype:
                    buffer = self._buffer(obj)
                    self._buffers[path] = buffer
                shared[alias] = buffer.copy_(obj.detach(), non_blocking=obj.is_cuda)
            return shared[alias]
        if isinstance(obj, dict):
            return {key: self._copy(value, (*path, key), shared) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(
                self._copy(value, (*path, index), shared) for index, value in enumerate(obj)
            )
        return obj

    def _buffer(self, obj: torch.Tensor) -> torch.Tensor:
        if not self._pinned(obj):
            return torch.empty(obj.shape, dtype=obj.dtype)
        ready = self._prepared.get((obj.shape, obj.dtype))
        return ready.pop() if ready else self._allocate(obj.shape, obj.dtype)

    def _cpu_mesh(self, mesh: Any) -> Any:
        """The same ranks in the same shape on the CPU, made once per mesh: a whole-world 1-D mesh
        reuses the default group; hsdp's 2-D one gets gloo groups bounded by the collective timeout
        (a collective every rank reaches here together)."""
        if mesh.device_type == "cpu":
            return mesh
        if mesh not in self._cpu_meshes:
            from torch.distributed.device_mesh import DeviceMesh

            self._cpu_meshes[mesh] = (
                two_d_mesh(mesh.mesh.tolist(), "cpu", self.timeout_s, backend="gloo")
                if mesh.ndim == 2
                else DeviceMesh("cpu", mesh.mesh, mesh_dim_names=mesh.mesh_dim_names)
            )
        return self._cpu_meshes[mesh]
