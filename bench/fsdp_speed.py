"""FSDP against DDP, and sharded checkpoints against torch.distributed.checkpoint called by hand.

Training: the main job's model on 2 gloo ranks, `train.parallel=ddp` and `=fsdp` alternated
(bench.train_speed's launcher and measurement). The communication differs: DDP all-reduces each
gradient bucket once per step; FSDP all-gathers every block's weights before its forward and again
before its backward, and reduce-scatters its gradients, so it moves about 1.5 times the bytes, in
more and smaller messages.

Checkpoints: 2 ranks shard a GPT-2 of about 25M parameters (model + AdamW state ~300 MB) with FSDP2;
each round times, on every rank between barriers, qgtrain's Checkpointer.save (staging, DCP write,
checksums, manifest, commit; fsync and rotation in the background) against `dcp.save` of the same
state written by hand (no checksums, no commit; sync_files=False, the faster setting), and the stall
of an async save. The order rotates every round: whichever save follows another 300 MB write pays
for its dirty pages. Usage: python -m bench.fsdp_speed [--rounds 4] [--steps 150] [--repeats 6]
[--only train|checkpoint]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import train_speed


def training(rounds: int, steps: int) -> None:
    parser = argparse.Namespace(
        preset="main", device="cpu", world=2, precision="fp32", compile=False, steps=steps, set=[]
    )
    rates: dict[str, list[float]] = {"ddp": [], "fsdp": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(rounds):
            for mode in ("ddp", "fsdp") if round_ % 2 == 0 else ("fsdp", "ddp"):
                parser.set = [f"train.parallel={mode}"]
                result = train_speed.run_qgtrain(Path(tmp), parser, f"{mode}-{round_}")
                rates[mode].append(result["steps_per_s"])
    med = {mode: statistics.median(values) for mode, values in rates.items()}
    print(
        f"training, main job's model, 2 gloo ranks, {rounds} rounds x {steps} steps: ddp "
        f"{med['ddp']:.3f} steps/s, fsdp {med['fsdp']:.3f}: ratio {med['fsdp'] / med['ddp']:.3f} "
        f"(rounds {', '.join(f'{f / d:.3f}' for f, d in zip(rates['fsdp'], rates['ddp']))})"
    )


def checkpoint_rank(
    rank: int, port: int, root: str, repeats: int, out: dict[str, list[float]]
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    from qgtrain.config import CheckpointConfig, ModelConfig, TrainConfig
    from qgtrain.runtime.distributed import process_group
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.state.checkpointer import Checkpointer
    from qgtrain.state.sharded import sharded_state
    from qgtrain.tasks.models import build_model
    from qgtrain.training.parallel.strategy import strategy_for

    env, cpu = from_environ(os.environ), torch.device("cpu")
    with process_group(env, cpu, 60, 600):
        torch.manual_seed(0)
        model = build_model(ModelConfig(layers=8, heads=8, hidden=512), 257, 128, 256)
        strategy_for(TrainConfig(parallel="fsdp"), env, cpu).wrap(model, False, "fp32")
        optimizer = torch.optim.AdamW(model.parameters())
        ids = torch.randint(0, 257, (2, 64))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        savers = {
            kind: Checkpointer(
                Path(root, kind),
                "bench",
                env,
                CheckpointConfig(keep_last=2, async_save=kind == "async"),
            )
            for kind in ("sync", "async")
        }
        steps = iter(range(1, 10**6))
        by_hand = iter(range(10**6))

        def ours(kind: str) -> None:
            savers[kind].save(
                next(steps),
                lambda: {},
                {"rng": torch.get_rng_state()},
                {},
                shards=sharded_state(model, optimizer),
            )

        def handwritten() -> None:
            index = next(by_hand)
            folder = Path(root, f"dcp-{index}")
            save(
                sharded_state(model, optimizer),
                process_group=None,
                storage_writer=FileSystemWriter(
                    folder, single_file_per_rank=True, sync_files=False
                ),
            )
            if rank == 0 and index >= 2:  # keep two, as qgtrain does
                shutil.rmtree(Path(root, f"dcp-{index - 2}"), ignore_errors=True)

        work = {
            "dcp.save by hand": handwritten,
            "qgtrain sync": lambda: ours("sync"),
            "qgtrain async": lambda: ours("async"),
        }
        names = list(work)
        # each round starts with the next one: the first after a write
        for round_ in range(repeats + 1):
            # of 300 MB pays for its dirty pages
            for name in names[round_ % 3 :] + names[: round_ % 3]:
                fn = work[name]
                for saver in savers.values():
                    saver.wait()  # the background part of the previous save is not this one's stall
                dist.barrier()
                start = time.perf_counter()
                fn()
                dist.barrier()
                if round_ and rank == 0:
                    out.setdefault(name, []).append(time.perf_counter() - start)
        for saver in savers.values():
            saver.wait()


def checkpoints(repeats: int) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = tempfile.mkdtemp(prefix="qgtrain-bench-")
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_collect, args=(port, root, repeats, out), nprocs=2)
            shared = dict(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {name: statistics.median(values) for name, values in shared.items()}
    base = med["dcp.save by hand"]
    print(
        f"sharded checkpoint, 2 ranks, ~300 MB of model + AdamW state, medians of {repeats}: "
        f"qgtrain {med['qgtrain sync'] * 1e3:.0f} ms, dcp.save by hand {base * 1e3:.0f} ms: ratio "
        f"{med['qgtrain sync'] / base:.3f} (goal <= 1.1); async stall "
        f"{med['qgtrain async'] * 1e3:.0f} ms: {med['qgtrain async'] / med['qgtrain sync']:.3f} of "
        "sync (goal <= 0.2)"
    )


def _collect(rank: int, port: int, root: str, repeats: int, out: dict[str, list[float]]) -> None:
    local: dict[str, list[float]] = {}
    checkpoint_rank(rank, port, root, repeats, local)
    if rank == 0:
        out.update(local)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument(
        "--repeats", type=int, default=6, help="rounds of the checkpoint part (a multiple of 3)"
    )
    parser.add_argument("--only", choices=("train", "checkpoint"))
    args = parser.parse_args()
    if args.only != "checkpoint":
        training(args.rounds, args.steps)
    if args.only != "train":
        checkpoints(args.repeats)


if __name__ == "__main__":
    main()
