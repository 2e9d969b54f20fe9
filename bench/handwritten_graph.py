"""The loop a user would write by hand for the graph classifier, the baseline qgtrain is measured
against.

Launched once per rank with torchrun's variables. It takes the user's side from
jobs/examples/graph.py (dataset, `pack` collate, model, loss) and writes the rest out again, without
qgtrain, as a user would: the model built under the same seed, torch's DistributedSampler with the
same seed, shuffling and drop_last (what qgtrain's ResumableSampler is), AdamW with decay on
matrices only, warmup then cosine, global-norm clipping, DDP (integer device ids on a GPU, none on
the CPU), gloo on the CPU. The settings come from the command line, which bench/graph_speed.py fills
from the resolved config, so neither side can drift from jobs/graph.yaml. Prints one JSON line per
logged step with the wall-clock time. Usage: see bench/graph_speed.py.
"""

import argparse
import contextlib
import dataclasses
import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from qgtrain.foundation.factory import load_factory

EXAMPLE = Path(__file__).resolve().parents[1] / "jobs" / "examples" / "graph.py"
SETTINGS = {
    "steps": int,
    "log_every": int,
    "batch": int,
    "graphs": int,
    "hidden": int,
    "layers": int,
    "seed": int,
    "lr": float,
    "min_lr": float,
    "warmup": int,
    "weight_decay": float,
    "beta1": float,
    "beta2": float,
    "eps": float,
    "grad_clip": float,
}


def get_lr(it: int, args: argparse.Namespace) -> float:
    """qgtrain.training.schedule.lr_at written out again: the baseline uses none of qgtrain's
    training code."""
    if args.warmup and it < args.warmup:
        return args.lr * (it + 1) / args.warmup
    progress = min(max(it - args.warmup, 0) / max(args.steps - args.warmup, 1), 1.0)
    return args.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (args.lr - args.min_lr)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, kind in SETTINGS.items():
        parser.add_argument(f"--{name}", type=kind, required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    args = parser.parse_args()
    pack, GraphClassifier, RandomGraphs, loss_fn = (
        load_factory(f"{EXAMPLE}:{name}", "example")
        for name in ("pack", "GraphClassifier", "RandomGraphs", "loss")
    )
    cuda = args.device == "cuda"
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if not cuda:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    torch.manual_seed(args.seed)
    model = GraphClassifier(args.hidden, args.layers).to(device)
    ddp = DDP(model, device_ids=[local_rank] if cuda else None)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": other, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(args.beta1, args.beta2),
        eps=args.eps,
        **({"fused": True} if cuda else {}),
    )
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if args.precision == "bf16"
        else contextlib.nullcontext()
    )
    sampler = DistributedSampler(
        RandomGraphs(args.graphs, args.seed),
        num_replicas=world,
        rank=rank,
        shuffle=True,
        seed=args.seed,
        drop_last=True,
    )
    loader = DataLoader(
        sampler.dataset,
        batch_size=args.batch,
        sampler=sampler,
        collate_fn=pack,
        drop_last=True,
        pin_memory=cuda,
    )
    epoch, batches = 0, iter(loader)
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step - 1, args)
        batch = next(batches, None)
        if batch is None:  # a new epoch, shuffled anew
            epoch += 1
            sampler.set_epoch(epoch)
            batches = iter(loader)
            batch = next(batches)
        batch = dataclasses.replace(
            batch,
            **{
                name: getattr(batch, name).to(device, non_blocking=True)
                for name in ("edges", "degree", "graph", "labels")
            },
        )
        with autocast:
            loss = loss_fn(ddp, batch)
        loss.backward()
        # 0: off, as in qgtrain
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == 1:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(
                    json.dumps({"step": step, "loss": mean.item() / world, "time": time.time()}),
                    flush=True,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
