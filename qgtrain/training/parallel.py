"""Wrapping the user's module for data-parallel training: DDP (a replica per rank) or FSDP2
(shards), with torch.compile where model.compile asks for it on this device (compiling.py). What
changes the model itself (adapters, SyncBatchNorm, activation checkpointing) has been applied
before (transforms.py)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..config import TrainConfig
from ..runtime import distributed, mesh
from ..runtime.rendezvous import DistEnv
from . import compiling, initial_shards, replicas, sharding

log = logging.getLogger("qgtrain")


def wrap(
    model: nn.Module,
    env: DistEnv,
    device: torch.device,
    compile_setting: compiling.Setting,
    train: TrainConfig,
    precision: str,
) -> nn.Module:
    """What forward and backward go through; `model` is moved to `device` here.

    DDP gets the local rank as an integer device id (never a torch.device, never the global rank).
    FSDP shards `model` in place, so it is both the module and what is wrapped; its weights come as
    shards from rank 0 (initial_shards.py). One process is not wrapped at all, so a laptop run has
    no DDP or FSDP overhead (fsdp on one rank shards nothing).
    """
    sharded = initial_shards.is_sharded_run(train, env.world_size)
    if not sharded:
        model = model.to(device)
    replicas.check_start(model, train.parallel, device, env.world_size)
    if sharded:
        blocks = sharding.find_blocks(model, train.shard_modules)
        log.info(
            "%s: sharding %d %s blocks and the root over %d ranks",
            train.parallel,
            len(blocks),
            type(blocks[0]).__name__,
            env.world_size,
        )
        full = initial_shards.set_aside_full_weights(model) if env.is_main else {}
        sharding.shard(model, blocks, precision, device, mesh.device_mesh(train, env, device))
        initial_shards.fill(model, full, device)
        return model
    blocks = compiling.repeated_blocks(model, train.shard_modules)
    compiling.apply(model, device, compile_setting, blocks)
    if env.world_size == 1:
        return model
    return DDP(
        model,
        device_ids=distributed.ddp_device_ids(device),
        find_unused_parameters=train.find_unused_parameters,
        gradient_as_bucket_view=True,
    )
