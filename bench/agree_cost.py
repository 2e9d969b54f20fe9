"""What agreeing on stop decisions at every step costs, by the way it is done (issue 17 asked for
each).

Two gloo ranks on the CPU train a GPT-2 with the trainer's own accumulate_gradients and optimizer
step, in alternating blocks of steps, each block one way of agreeing on the five stop flags every
step:
  none   no agreement (the floor);
  sync   a blocking all-reduce after the step (what qgtrain did before 2026-11-23);
  async  an all-reduce started before the forward and read after the backward (what the trainer
         does);
  fold   the flags appended to DDP's last gradient bucket by a comm hook, so no collective of their
         own: free in messages, but the bucket is copied once more every step.
Each is reported as its median step time over the floor's. Usage: python -m bench.agree_cost
[--preset main|tiny] [--rounds 4] [--steps 60]
"""

import argparse
import os
import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import torchrun_env

PRESETS = {"main": {}, "tiny": {"hidden": 8, "layers": 1, "heads": 1, "seq": 8, "batch": 1}}
WAYS = ["none", "sync", "async", "fold"]


def fold_hook(state: dict[str, Any], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's averaging all-reduce; on the last bucket the pending flags travel with the gradients.
    (DDP checks these annotations as objects: this file has no `from __future__ import
    annotations`.)"""
    tensor = bucket.buffer().div_(dist.get_world_size())
    flags = state.pop("flags", None) if bucket.is_last() else None
    if flags is None:
        return dist.all_reduce(tensor, async_op=True).get_future().then(lambda fut: fut.value()[0])
    joined = torch.cat([tensor, flags.to(tensor.dtype)])

    def split(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        out = fut.value()[0]
        state["agreed"] = out[tensor.numel() :]
        return out[: tensor.numel()]

    return dist.all_reduce(joined, async_op=True).get_future().then(split)


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace, out: Any) -> None:
    os.environ.update(torchrun_env(rank, world, port))
    from torch.nn.parallel import DistributedDataParallel as DDP

    from qgtrain.config import ModelConfig, RunConfig
    from qgtrain.runtime import cpu, distributed, rng
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.tasks.models import build_model, lm_loss
    from qgtrain.training.optimizers import adamw
    from qgtrain.training.parallel.step import accumulate_gradients
    from qgtrain.training.parallel.strategy import strategy_for

    env, device, cfg = from_environ(os.environ), torch.device("cpu"), RunConfig()
    strategy = strategy_for(cfg.train, env, device)
    shape = {
        "hidden": cfg.model.hidden,
        "layers": cfg.model.layers,
        "heads": cfg.model.heads,
        "seq": cfg.data.seq_len,
        "batch": cfg.train.batch_size,
        **PRESETS[args.preset],
    }
    cpu.set_cpu_threads(env, 0)
    cpu.keep_freed_memory()
    with distributed.process_group(env, device, 60, 60):

        def wrapped(hooked: bool) -> tuple[torch.nn.Module, DDP, torch.optim.Optimizer]:
            rng.seed_everything(0)
            model = build_model(
                ModelConfig(hidden=shape["hidden"], layers=shape["layers"], heads=shape["heads"]),
                257,
                shape["seq"],
                256,
            )
            ddp = DDP(model)
            if hooked:
                ddp.register_comm_hook(hook_state, fold_hook)  # type: ignore[arg-type]
            return model, ddp, adamw(model, cfg.optim, device)

        hook_state: dict[str, Any] = {}
        plain, folded = wrapped(False), wrapped(True)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        batch = torch.randint(
            0, 257, (shape["batch"], shape["seq"]), generator=torch.Generator().manual_seed(0)
        )
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for index in range(args.rounds):
            for way in WAYS[index % len(WAYS) :] + WAYS[: index % len(WAYS)]:
                model, ddp, optimizer = folded if way == "fold" else plain
                for step in range(args.steps):
                    start = time.perf_counter()
                    flags = [False, False, False, False, False]
                    finish = (
                        distributed.any_flags_later(
                            torch.tensor(flags, dtype=torch.int32, device=device)
                        )
                        if way == "async"
                        else None
                    )
                    if way == "fold":
                        hook_state["flags"] = torch.tensor(flags, dtype=torch.float32)
                    accumulate_gradients(
                        ddp, lm_loss, [batch], "fp32", scaler, device, strategy=strategy
                    )
                    if finish is not None:
                        finish().tolist()
                    elif way == "fold":
                        hook_state.pop("agreed").tolist()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    if way == "sync":
                        distributed.any_flags(flags, device)
                    if step >= 5:  # the first steps of a block warm its caches
                        times[way].append(time.perf_counter() - start)
        if rank == 0:
            out.update({way: statistics.median(values) for way, values in times.items()})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", choices=sorted(PRESETS), default="main")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(rank_main, args=(2, port, args, out), nprocs=2)
    floor = out["none"]
    print(
        f"{args.preset} model, 2 gloo ranks, median step {floor * 1e3:.2f} ms without agreeing "
        f"({args.rounds} rounds x {args.steps} steps per way)"
    )
    for way in WAYS[1:]:
        print(f"{way:>5}: {(out[way] - floor) * 1e6:+.0f} us per step, {out[way] / floor - 1:+.2%}")


if __name__ == "__main__":
    main()
