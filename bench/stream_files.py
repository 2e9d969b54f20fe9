"""Streamed data files (data.stream: true) against the same files tokenized into the cache, side
by side in one process on one generated JSON Lines file of --mb megabytes (random words, 0.5-4 kB
documents, the byte tokenizer):

- time to the first batch: the cache made (tokenizing every document) and opened, against the
  stream's plan, its held-out splits and its first batch (goal: at most half);
- samples/s of a rank's loader with 2 workers, after the first batch (goal: >= 0.9x the cached);
- resume: from a saved position early and late in the file to the next sample, by the stream's
  state (a seek) and by reading past what was consumed (goal: the state's time does not grow).

Rounds alternate baseline and candidate. Usage: python -m bench.stream_files [--mb 150] [--rounds 3]
[--batches 600]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import report
from qgtrain.config import DataConfig
from qgtrain.data.cache import prepare
from qgtrain.data.loaders import ResumableSampler, make_loader, stream_loader
from qgtrain.data.stream import filestream
from qgtrain.runtime.rendezvous import DistEnv
from qgtrain.tasks.causal_lm import build_splits

WORDS = (
    "rank node slurm batch token model epoch shard cache resume signal queue gradient "
    "optimizer loss stream file worker sample position"
).split()
SEQ, BATCH, WORKERS = 512, 16, 2
CPU = torch.device("cpu")


def make_file(path: Path, megabytes: float) -> None:
    rng, size = random.Random(0), 0
    with open(path, "w") as out:
        while size < megabytes * 1e6:
            line = json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(80, 600)))}) + "\n"
            out.write(line)
            size += len(line)


def first_batch(data: DataConfig, stream: bool) -> float:
    start = time.perf_counter()
    splits = build_splits(
        replace(data, stream=stream), None if stream else prepare.prepare(data)[0], 0
    )
    next(iter(loader(splits.train, stream)))
    return time.perf_counter() - start


def loader(train: object, stream: bool) -> torch.utils.data.DataLoader:  # type: ignore[type-arg]
    if stream:
        return stream_loader(train, BATCH, WORKERS, CPU, 0, None)
    sampler = ResumableSampler(train, DistEnv(rank=0, world_size=1), 0, True, True)  # type: ignore
    return make_loader(train, sampler, BATCH, WORKERS, CPU, 0, True)  # type: ignore[arg-type]


def throughput(data: DataConfig, stream: bool, batches: int) -> float:
    splits = build_splits(
        replace(data, stream=stream), None if stream else prepare.prepare(data)[0], 0
    )
    drawn = iter(loader(splits.train, stream))
    next(drawn)
    start = time.perf_counter()
    for _ in range(batches):
        next(drawn)
    return batches * BATCH / (time.perf_counter() - start)


def resume(plan: filestream.StreamPlan, state: dict[str, object], skip: int) -> float:
    """Seconds to the next sample: from the state, or (skip > 0) by reading past `skip` samples."""
    start = time.perf_counter()
    reader = filestream.FileReader(plan, 0, 1)
    if skip:
        samples = iter(reader)
        for _ in range(skip):
            next(samples)
        next(samples)
    else:
        reader.load_state_dict(state)
        next(iter(reader))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, default=600)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="stream-bench-"))
    try:
        make_file(folder / "big.jsonl", args.mb)
        data = DataConfig(
            name="files",
            files=(str(folder / "big.jsonl"),),
            seq_len=SEQ,
            cache_dir=str(folder / "cache"),
            prepare_workers=1,
        )
        print(f"{args.mb:g} MB of JSON Lines, seq_len {SEQ}, batch {BATCH}, {WORKERS} workers")
        starts: dict[str, list[float]] = {"stream": [], "cache": []}
        for _ in range(args.rounds):
            shutil.rmtree(folder / "cache", ignore_errors=True)
            starts["cache"].append(first_batch(data, False))
            starts["stream"].append(first_batch(data, True))
        report("time to the first batch", starts, "stream", "cache", "<= 0.5")
        rates: dict[str, list[float]] = {"stream": [], "cache": []}
        for _ in range(args.rounds):
            rates["cache"].append(1 / throughput(data, False, args.batches))
            rates["stream"].append(1 / throughput(data, True, args.batches))
        ratio = report("seconds per sample", rates, "stream", "cache", "<= 1/0.9 = 1.11")
        print(
            f"samples/s: stream {1 / statistics.median(rates['stream']):,.0f}, cache "
            f"{1 / statistics.median(rates['cache']):,.0f}, ratio {1 / ratio:.3f} (goal >= 0.9)"
        )
        plan = filestream.plan(replace(data, stream=True), 0)
        for name, fraction in (("early", 0.02), ("late", 0.9)):
            reader, skip = filestream.FileReader(plan, 0, 1), 0
            target = int(fraction * args.mb * 1e6 / SEQ * 0.95)
            for skip, _ in enumerate(reader):
                if skip + 1 >= target:
                    break
            state = reader.state_dict()
            times = {
                "state": [resume(plan, state, 0) for _ in range(args.rounds)],
                "replay": [resume(plan, state, skip + 1)],
            }
            print(
                f"resume {name} (after {skip + 1:,} samples, "
                f"{100 * fraction:g}% of the file): state "
                f"{statistics.median(times['state']) * 1e3:.1f} ms, reading past "
                f"{statistics.median(times['replay']) * 1e3:.0f} ms"
            )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
