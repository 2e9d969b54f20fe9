"""How the ranks hold the model, answered in one place: one process, a replica on every rank (ddp),
or shards (fsdp; hsdp: shards within a group, replicas across groups).

A run builds its strategy once (`strategy_for`, before the task: it says which ranks build weights)
and sets the model up with it (`setup`: the wrap and initial shards, then the optimizer, kept as
step.py's ParallelModel, which owns a step's backward, clip and update). Every part whose work
depends on the strategy asks it: a step's reduction, autocast and norm, the EMA's gathered weights,
the replicas' agreement before a checkpoint or an evaluation, whether evaluation runs in lockstep,
the checkpoint's parts (their state dicts and route: rank 0's files or every rank's DCP shards).
Nothing else asks which strategy it is, so another (CPU offload, say) is one more class here.

| strategy | when | what it holds on a rank |
|---|---|---|
| `Strategy` | one rank, any train.parallel | the whole model, unwrapped |
| `Replicas` | ddp on more ranks | the whole model, in DDP |
| `Shards` | fsdp on more ranks | its shards (FSDP2 on a 1-D mesh) |
| `GroupShards` | hsdp on more ranks | its shards within its group (a 2-D mesh) |
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ...config import TrainConfig
from ...runtime import distributed, mesh
from ...runtime.rendezvous import DistEnv
from ...state.sharded import shard_of
from ...state.stateful import (
    ModelState,
    OptimizerState,
    ShardedModelState,
    ShardedOptimizerState,
    Stateful,
)
from . import compiling, initial_shards, replicas, sharding
from .step import ParallelModel

log = logging.getLogger("qgtrain")


@dataclass(frozen=True)
class Strategy:
    """One process: the whole model on this rank, nothing wrapped (no DDP or FSDP overhead on a
    laptop), no one to agree with. Every other strategy answers what differs from this."""

    train: TrainConfig
    env: DistEnv
    device: torch.device

    # the checkpoint's route: every rank writes its shards by DCP, not rank 0 replicated files
    saves_shards: ClassVar[bool] = False
    # a sharded forward is a collective: every rank evaluates as many batches
    evaluates_in_lockstep: ClassVar[bool] = False
    # DDP waits for every trained parameter's gradient: an unused one would hang the step
    needs_every_gradient: ClassVar[bool] = False

    def builds_empty(self, resuming: bool) -> bool:
        """Whether this rank builds the task's model without weights (initial_shards.py)."""
        return False

    def sync_batchnorm_problem(self) -> str | None:
        """Why train.sync_batchnorm cannot run here, or None. One rank's batch is the global
        batch: nothing is converted."""
        return None

    def setup(
        self,
        model: nn.Module,
        compile_setting: compiling.Setting,
        precision: str,
        optimizer: Callable[[], torch.optim.Optimizer],
        scaler: torch.amp.GradScaler,
    ) -> ParallelModel:
        """`model` wrapped, then its optimizer built on what the wrap made (fsdp's shards)."""
        wrapped = self.wrap(model, compile_setting, precision)
        return ParallelModel(self, model, wrapped, optimizer(), scaler, precision)

    def wrap(
        self, model: nn.Module, compile_setting: compiling.Setting, precision: str
    ) -> nn.Module:
        """What forward and backward go through; `model` is moved to the device here."""
        return self._compiled(model.to(self.device), compile_setting)

    def _compiled(self, model: nn.Module, compile_setting: compiling.Setting) -> nn.Module:
        blocks = compiling.repeated_blocks(model, self.train.shard_modules)
        compiling.apply(model, self.device, compile_setting, blocks)
        return model

    def reduction_deferred(
        self, wrapped: nn.Module, defer: bool
    ) -> contextlib.AbstractContextManager[object]:
        """What a micro-batch but the last may postpone without holding more memory."""
        return contextlib.nullcontext()

    def autocast_precision(self, precision: str) -> str:
        """The precision autocast computes in around the forward."""
        return precision

    def whole_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The model's gradient norm from the norm of what this rank holds: the same here."""
        return norm

    def agree_before_save(self, model: nn.Module, wrapped: nn.Module, step: int) -> None:
        """Every rank, before a checkpoint: make the replicas agree, or stop where they cannot."""

    def agree_before_evaluation(self, model: nn.Module, wrapped: nn.Module) -> None:
        """Every rank evaluates with the buffers the saved model holds (rank 0's)."""

    def release_gathered(self, model: nn.Module) -> None:
        """Drop full parameters gathered by a forward, so the next one gathers what is there now
        (the EMA swaps its average in and out)."""

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """What of a parameter (or a tensor laid out like one: the EMA's average) this rank
        holds, as a plain tensor."""
        return tensor

    def model_state(self, model: nn.Module) -> Stateful:
        return ModelState(model)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Stateful:
        return OptimizerState(model, optimizer)

    def copies_to_save(self) -> bool:
        """Whether this rank's saves copy tensors from the device (host_copy.py pins for them)."""
        return self.env.is_main


class Replicas(Strategy):
    """ddp: a whole replica per rank, its gradients all-reduced; rank 0's files are the
    checkpoint."""

    needs_every_gradient = True

    def sync_batchnorm_problem(self) -> str | None:
        """torch 2.13's SyncBatchNorm computes on GPUs only (its forward refuses CPU input, and DDP
        refuses CPU modules that hold one)."""
        if self.device.type != "cpu":
            return None
        return (
            "train.sync_batchnorm: SyncBatchNorm runs on GPUs only (torch refuses CPU tensors), "
            f"and these {self.env.world_size} ranks train on the CPU. HINT: set "
            "train.sync_batchnorm: false (each rank then normalizes by its own batch, and the "
            "running statistics are rank 0's), or train on GPUs"
        )

    def wrap(
        self, model: nn.Module, compile_setting: compiling.Setting, precision: str
    ) -> nn.Module:
        """DDP gets the local rank as an integer device id (never a torch.device, never the global
        rank)."""
        model = model.to(self.device)
        replicas.check_start_replicated(model, self.device)
        return DDP(
            self._compiled(model, compile_setting),
            device_ids=distributed.ddp_device_ids(self.device),
            find_unused_parameters=self.train.find_unused_parameters,
            gradient_as_bucket_view=True,
        )

    def reduction_deferred(
        self, wrapped: nn.Module, defer: bool
    ) -> contextlib.AbstractContextManager[object]:
        """The all-reduce waits for the last micro-batch (no_sync): each rank's gradients are
        full-size anyway."""
        return cast(DDP, wrapped).no_sync() if defer else contextlib.nullcontext()

    def agree_before_save(self, model: nn.Module, wrapped: nn.Module, step: int) -> None:
        replicas.check_replicas_agree(model, cast(DDP, wrapped), step, self.device)

    def agree_before_evaluation(self, model: nn.Module, wrapped: nn.Module) -> None:
        replicas.take_main_values(replicas.broadcast_by_ddp(cast(DDP, wrapped)))


class Shards(Strategy):
    """fsdp: each rank holds its shards of the model over all ranks; the model is both the module
    and what is wrapped (sharded in place), its initial weights sent from rank 0."""

    saves_shards = True
    evaluates_in_lockstep = True

    def builds_empty(self, resuming: bool) -> bool:
        """Every rank but rank 0, and rank 0 too when a checkpoint will fill the shards."""
        return resuming or not self.env.is_main

    def sync_batchnorm_problem(self) -> str | None:
        return (
            "train.sync_batchnorm: applies to train.parallel: ddp; with fsdp each rank normalizes "
            "by its own batch. HINT: set train.sync_batchnorm: false, or train with ddp"
        )

    def wrap(
        self, model: nn.Module, compile_setting: compiling.Setting, precision: str
    ) -> nn.Module:
        replicas.check_start_sharded(model, self.device)
        blocks = sharding.find_blocks(model, self.train.shard_modules)
        log.info(
            "%s: sharding %d %s blocks and the root over %d ranks",
            self.train.parallel,
            len(blocks),
            type(blocks[0]).__name__,
            self.env.world_size,
        )
        full = initial_shards.set_aside_full_weights(model) if self.env.is_main else {}
        compiling.apply(model, self.device, compile_setting, blocks)  # each block, then sharded
        sharding.shard(model, blocks, precision, self.device, self.mesh())
        initial_shards.fill(model, full, self.device)
        return model

    def mesh(self) -> Any:
        return mesh.flat_mesh(self.env.world_size, self.device)

    def reduction_deferred(
        self, wrapped: nn.Module, defer: bool
    ) -> contextlib.AbstractContextManager[object]:
        """Nothing: skipping the reduce-scatter would keep every parameter's *unsharded* gradient,
        upcast to the fp32 reduce dtype, until the last micro-batch
        (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, FSDPParamGroup.post_backward
        when reduce_grads is false; _fsdp_param.py, FSDPParam.to_accumulated_grad_if_needed): 4
        bytes x all parameters on every rank, where reducing each micro-batch keeps only this
        rank's shard."""
        return contextlib.nullcontext()

    def autocast_precision(self, precision: str) -> str:
        """None: the model computes in its FSDP MixedPrecisionPolicy's param_dtype
        (sharding.shard); autocast on top of FSDP casts every weight again and keeps a second
        low-precision copy (FSDP's documentation)."""
        return "fp32"

    def agree_before_save(self, model: nn.Module, wrapped: nn.Module, step: int) -> None:
        """FSDP2 broadcasts nothing, and a sharded checkpoint keeps one copy of a replicated
        buffer: every rank takes rank 0's."""
        replicas.take_main_values(list(model.buffers()))

    def agree_before_evaluation(self, model: nn.Module, wrapped: nn.Module) -> None:
        replicas.take_main_values(list(model.buffers()))

    def whole_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """Each rank's gradients are its shards': their norm is reduced over the ranks (a partial
        DTensor's full_tensor) before any rank clips."""
        shard = shard_of(norm)
        return shard.full_tensor() if shard is not None else norm

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        shard = shard_of(tensor)
        return shard.to_local() if shard is not None else tensor

    def release_gathered(self, model: nn.Module) -> None:
        """FSDP keeps the root's parameters after a forward without backward."""
        fsdp = sys.modules["torch.distributed.fsdp"]
        for module in model.modules():
            if isinstance(module, fsdp.FSDPModule):
                module.reshard()

    def model_state(self, model: nn.Module) -> Stateful:
        return ShardedModelState(model)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Stateful:
        return ShardedOptimizerState(model, optimizer)

    def copies_to_save(self) -> bool:
        return True


class GroupShards(Shards):
    """hsdp: shards within a shard group (a node: all-gathers and reduce-scatters stay on its fast
    links), the groups replicas of each other (runtime/mesh.py)."""

    def mesh(self) -> Any:
        return mesh.hsdp_mesh(self.train, self.env, self.device)

    def reduction_deferred(
        self, wrapped: nn.Module, defer: bool
    ) -> contextlib.AbstractContextManager[object]:
        """Only the all-reduce across replicas waits (FSDPModule.set_requires_all_reduce;
        _fsdp_param_group.py all_reduce_grads); the reduce-scatter within a group still runs, as
        torchtitan does it. One group is fsdp: there is no such all-reduce."""
        first = shard_of(next(wrapped.parameters(), None))
        if first is not None and first.device_mesh.ndim == 2:
            cast(Any, wrapped).set_requires_all_reduce(not defer)
        return contextlib.nullcontext()


KINDS: dict[str, type[Strategy]] = {"ddp": Replicas, "fsdp": Shards, "hsdp": GroupShards}


def strategy_for(train: TrainConfig, env: DistEnv, device: torch.device) -> Strategy:
    """The run's strategy: train.parallel's on more than one rank; on one, every strategy is the one
    process (fsdp on one rank shards nothing)."""
    kind = KINDS[train.parallel] if env.world_size > 1 else Strategy
    return kind(train, env, device)
