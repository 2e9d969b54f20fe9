"""The per-step cost of agreeing on stop decisions: one tiny all-reduce at every step boundary (the default,
train.agree_every=1), against the training step it guards.

Two gloo ranks on the CPU train the main job's model (config.yaml's tiny GPT-2) with the trainer's own
accumulate_gradients and optimizer step; each step is timed, and so is the agreement call placed where the
trainer places it. Usage: python -m bench.agree_cost [--steps 60]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.multiprocessing as mp


def rank_main(rank: int, world: int, port: int, steps: int, out: dict) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    from torch.nn.parallel import DistributedDataParallel as DDP

    from qgtrain.config import RunConfig
    from qgtrain.runtime import cpu, distributed, rng
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.tasks.models import build_model, lm_loss
    from qgtrain.training.gradients import accumulate_gradients
    from qgtrain.training.optim import adamw

    env, device, cfg = from_environ(os.environ), torch.device("cpu"), RunConfig()
    cpu.set_cpu_threads(env, 0)
    cpu.keep_freed_memory()
    with distributed.process_group(env, device, 60, 60):
        rng.seed_everything(0)
        model = build_model(cfg.model, 257, cfg.data.seq_len, 256)
        ddp, optimizer = DDP(model), adamw(model, cfg.optim, device)
        scaler = torch.amp.GradScaler("cpu", enabled=False)
        batch = torch.randint(0, 257, (cfg.train.batch_size, cfg.data.seq_len))
        step_times, agree_times = [], []
        for _ in range(steps):
            start = time.perf_counter()
            loss = accumulate_gradients(ddp, lm_loss, [batch], "fp32", scaler, device)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_times.append(time.perf_counter() - start)
            start = time.perf_counter()
            distributed.any_flags([~torch.isfinite(loss), False, False, False, False], device)
            agree_times.append(time.perf_counter() - start)
        if rank == 0:
            out["step"] = statistics.median(step_times[5:])
            out["agree"] = statistics.median(agree_times[5:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = mp.Manager().dict()
    mp.spawn(rank_main, args=(2, port, args.steps, out), nprocs=2)
    share = out["agree"] / (out["step"] + out["agree"])
    print(f"agreement all-reduce: median {out['agree'] * 1e6:.0f} us per step; training step median "
          f"{out['step'] * 1e3:.1f} ms; cost {share:.2%} of a step at train.agree_every=1 (goal < 1%)")


if __name__ == "__main__":
    main()
