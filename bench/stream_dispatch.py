"""What data.dispatch costs against every rank reading its own part of a stream (issue 35).

Two gloo ranks on the CPU read the same data.mix (two cached sources of random tokens, weights 2:1,
each sample optionally made to cost --decode-us of CPU, as decoding and tokenizing would) in
alternating blocks of steps, through the classes a run uses:
  per-rank    StreamBatches: each rank's loader workers read its own slots of the mixture, and the
              ranks agree each step on whether a stream ended (one small all-reduce);
  dispatched  DispatchedBatches: rank 0's workers read every rank's batches, and one scatter of
              pickled batches sends each rank its own.
A step here is the data only (plus --compute-ms of sleep standing for forward and backward, during
which the loader workers read ahead). Reported: each way's median step time on rank 0, as
samples/s of both ranks, and the ratio dispatched / per-rank.
Usage: python -m bench.stream_dispatch [--steps 40] [--rounds 3] [--workers 2] [--batch 8]
[--seq 512] [--decode-us 0] [--compute-ms 0]
"""

import argparse
import functools
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import torchrun_env

WAYS = ["per-rank", "dispatched"]


class SlowReader:
    """A cached source whose every sample costs `decode_us` of CPU, as decoding text would."""

    def __init__(self, decode_us: float, *args: Any) -> None:
        from qgtrain.data.mixture.cached import CachedReader

        self.inner, self.decode_s = CachedReader(*args), decode_us / 1e6

    def __iter__(self) -> Any:
        for sample in self.inner:
            until = time.perf_counter() + self.decode_s
            while time.perf_counter() < until:
                pass
            yield sample

    def next_pass(self) -> None:
        self.inner.next_pass()

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


def rank_main(
    rank: int, world: int, port: int, args: argparse.Namespace, folder: str, out: Any
) -> None:
    os.environ.update(torchrun_env(rank, world, port))
    from qgtrain.data.loaders import stream_loader
    from qgtrain.data.mixture.mix import Mixture, Source
    from qgtrain.data.stream.dispatch import DispatchedBatches
    from qgtrain.data.stream.streams import StreamBatches
    from qgtrain.data.tokens import TokenWindows
    from qgtrain.runtime import distributed
    from qgtrain.runtime.rendezvous import from_environ

    env, cpu = from_environ(os.environ), torch.device("cpu")
    torch.set_num_threads(1)
    with distributed.process_group(env, cpu, 60, 60):
        group = dist.new_group(backend="gloo")

        def mixture(reader_rank: int, readers: int) -> Mixture:
            sources = [
                Source(
                    name,
                    weight,
                    functools.partial(
                        SlowReader,
                        args.decode_us,
                        TokenWindows(str(Path(folder, f"{name}.bin")), "uint16", args.seq),
                        seed,
                    ),
                )
                for seed, (name, weight) in enumerate((("web", 2.0), ("code", 1.0)))
            ]
            return Mixture(sources, 0, reader_rank, readers)

        def loader(reader_rank: int, readers: int) -> Any:
            return stream_loader(
                mixture(reader_rank, readers), args.batch, args.workers, cpu, rank, None
            )

        samples = args.batch * world
        ways = {
            "per-rank": StreamBatches(loader(rank, world), samples, 0, "bench", group),
            "dispatched": DispatchedBatches(loader(0, 1), samples, 0, "bench", group),
        }
        positions = {way: SimpleNamespace(epoch=0, samples_in_epoch=0) for way in WAYS}
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for index in range(args.rounds):
            for way in WAYS[index % 2 :] + WAYS[: index % 2]:
                dist.barrier(group)
                for step in range(args.steps):
                    start = time.perf_counter()
                    ways[way].step(positions[way], 1)
                    time.sleep(args.compute_ms / 1e3)
                    if step >= 5:  # a block's first steps start its workers' read-ahead
                        times[way].append(time.perf_counter() - start)
        if rank == 0:
            out.update({way: statistics.median(values) for way, values in times.items()})
            out["n"] = len(times["per-rank"])


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, default in (("steps", 40), ("rounds", 3), ("workers", 2), ("batch", 8), ("seq", 512)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--decode-us", type=float, default=0.0)
    parser.add_argument("--compute-ms", type=float, default=0.0)
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as folder:
        tokens = np.random.default_rng(0).integers(0, 50_000, 4096 * args.seq, dtype=np.uint16)
        for name in ("web", "code"):
            tokens.tofile(Path(folder, f"{name}.bin"))
        out = mp.Manager().dict()
        mp.spawn(rank_main, args=(2, port, args, folder, out), nprocs=2)
    speed = {way: args.batch * 2 / out[way] for way in WAYS}
    print(
        f"2 gloo ranks x {args.workers} workers, batch {args.batch} x seq {args.seq}, decode "
        f"{args.decode_us:g} us/sample, compute {args.compute_ms:g} ms/step; medians of "
        f"{out['n']} steps each"
    )
    for way in WAYS:
        print(f"{way:>10}: median step {out[way] * 1e3:.2f} ms, {speed[way]:.0f} samples/s")
    print(f"dispatched / per-rank samples/s: {speed['dispatched'] / speed['per-rank']:.3f}")


if __name__ == "__main__":
    main()
