"""Mid-epoch resume: time from a restored data position to the first batch, at positions early and
late in an epoch, against the loop users write first (iterate the loader and discard batches up to
the position).

One rank of two reads a memory-mapped token file of 400k windows through qgtrain's ResumableSampler
and loader, as the trainer does on resume. qgtrain's time should not depend on the position;
replaying grows with it. Usage: python -m bench.resume_seek [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from qgtrain.data.loaders import ResumableSampler, make_loader
from qgtrain.data.tokens import TokenWindows
from qgtrain.runtime.rendezvous import DistEnv

WINDOWS, SEQ, BATCH = 400_000, 64, 16
ENV = DistEnv(rank=0, world_size=2)


def first_batch_after(dataset: TokenWindows, consumed: int, replay: bool) -> float:
    """Seconds from 'resume at `consumed` samples of epoch 3' to holding the next batch."""
    start = time.perf_counter()
    sampler = ResumableSampler(dataset, ENV, seed=1337, shuffle=True, drop_last=True)
    loader = make_loader(dataset, sampler, BATCH, 0, torch.device("cpu"), seed=1337, drop_last=True)
    if replay:
        sampler.set_epoch(3)
        batches = iter(loader)
        for _ in range(consumed // (BATCH * ENV.world_size)):
            next(batches)
    else:
        sampler.set_position(3, consumed)
        batches = iter(loader)
    next(batches)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qgtrain-seek-") as work:
        path = Path(work) / "tokens.bin"
        np.random.default_rng(0).integers(0, 256, WINDOWS * SEQ, dtype=np.uint16).tofile(path)
        dataset = TokenWindows(str(path), "uint16", SEQ)
        step = BATCH * ENV.world_size
        positions = {
            f"{fraction:.0%}": int(WINDOWS * fraction) // step * step
            for fraction in (0.0, 0.1, 0.5, 0.9)
        }
        times: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.repeats):  # positions interleaved, so drift hits all alike
            for label, consumed in positions.items():
                for name in ("qgtrain", "replay"):
                    gc.collect()
                    times.setdefault((name, label), []).append(
                        first_batch_after(dataset, consumed, replay=name == "replay")
                    )
        results = {
            name: {label: statistics.median(times[name, label]) for label in positions}
            for name in ("qgtrain", "replay")
        }
        for label, consumed in positions.items():
            print(
                f"position {label:>4} of the epoch ({consumed} samples): qgtrain "
                f"{results['qgtrain'][label] * 1e3:.1f} ms, replaying "
                f"{results['replay'][label] * 1e3:.1f} ms"
            )
        q = results["qgtrain"]
        print(
            "qgtrain time to the first batch at 90% / at 0% of the epoch: "
            f"{q['90%'] / q['0%']:.2f} (goal: about 1, independent of the position); replaying: "
            f"{results['replay']['90%'] / results['replay']['0%']:.0f}"
        )


if __name__ == "__main__":
    main()
