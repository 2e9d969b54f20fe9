"""The step loop's stall per save, the node-local tier against the shared one, blocking and
asynchronous, on 2 gloo ranks that stand for two nodes (each its own local folder, each keeping the
other's replica).

Each rank holds a stack of Linear(1024, 1024) layers and its AdamW state (ddp: whole on every
rank; --parallel fsdp: each layer sharded over the two) and saves it through the real Checkpointer:
`save_parts` is what the trainer calls at a due step, so its time is the loop's stall. The four
ways alternate, `--repeats` times each, the background work of one finished (untimed) before the
next starts; the stall is the slower rank's. On one machine both tiers write to the same disk: the
difference shown is qgtrain's own path (the shared tier's staging, manifest, commit, fsync and
rotation; the local tier's part, record and replica sent to the other rank); on a cluster the shared
tier adds its filesystem's cost. Usage: python -m bench.checkpoint_tiers [--params-m 1]
[--parallel ddp|fsdp] [--repeats 5] [--dir PATH]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from qgtrain.config import CheckpointConfig
from qgtrain.runtime.distributed import process_group
from qgtrain.runtime.rendezvous import from_environ
from qgtrain.state import local_tier
from qgtrain.state.checkpointer import Checkpointer, Why
from qgtrain.state.stateful import (
    ModelState,
    OptimizerState,
    RngState,
    RunFacts,
    ShardedModelState,
    ShardedOptimizerState,
)

WAYS = ("shared, blocking", "shared, async", "local, blocking", "local, async")


def rank_main(rank: int, args: argparse.Namespace, port: int, root: str) -> None:
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="1",  # two ranks, two nodes
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    env = from_environ(os.environ)
    with process_group(env, torch.device("cpu"), 60, 600):
        stalls = measure(env, args, Path(root))
        everyone: list[Any] = [None, None]
        dist.all_gather_object(everyone, stalls)
        if rank == 0:
            for way in WAYS:
                slower = [max(a, b) for a, b in zip(everyone[0][way], everyone[1][way])]
                print(
                    f"{way}: stall median {statistics.median(slower) * 1e3:.1f} ms "
                    f"(n={len(slower)})"
                )


def measure(env: Any, args: argparse.Namespace, root: Path) -> dict[str, list[float]]:
    width = 1024
    layers = max(1, round(args.params_m * 1e6 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    fsdp = args.parallel == "fsdp"
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model:
            fully_shard(layer)
        fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    facts = RunFacts(model, "fp32", env)
    parts = {
        "facts": facts,
        "rng": RngState(facts, env, 0, lambda: 0),
        "model": ShardedModelState(model) if fsdp else ModelState(model),
        "optimizer": (ShardedOptimizerState if fsdp else OptimizerState)(model, optimizer),
    }
    cfg = CheckpointConfig(
        keep_last=2, local_dir=str(root / f"node{env.rank}"), local_every_steps=1
    )
    tier = local_tier.opened(cfg, env, "bench", fsdp, args.parallel, 600)
    saver = Checkpointer(root / "shared", "bench", env, cfg, saves_shards=fsdp, local=tier)
    if env.is_main:
        mb = sum(p.numel() for p in model.parameters()) * 4 * 3 / 1e6  # a DTensor's: the whole
        print(f"{layers} x Linear({width}, {width}) under {args.parallel}: {mb:.0f} MB of state")
    stalls: dict[str, list[float]] = {way: [] for way in WAYS}
    step = 0
    for repeat in range(args.repeats + 1):  # the first round warms up, untimed
        for way in WAYS:
            step += 1
            saver.async_save = way.endswith("async")
            dist.barrier()
            started = time.perf_counter()
            saver.save_parts(step, parts, {}, Why.LOCAL if way.startswith("local") else Why.EVERY)
            took = time.perf_counter() - started
            saver.wait()
            dist.barrier()
            if repeat:
                stalls[way].append(took)
    return stalls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params-m", type=float, default=1.0, help="millions of parameters")
    parser.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where both tiers write (default: a tmp dir)")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="qgtrain-tiers-", dir=args.dir) as root:
        mp.spawn(rank_main, args=(args, port, root), nprocs=2)


if __name__ == "__main__":
    main()
