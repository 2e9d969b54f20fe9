"""Tokenizing data files: qgtrain's preparation against a plain loop calling the same fast tokenizer
over the same files in one process, and its scaling with worker processes; then the time to the
first training step on a prepared cache against the built-in corpus's.

The data is real text: Python's standard library as jsonl shards (one document per source file),
with a byte-level BPE tokenizer of 8,192 tokens trained on it here. Both sides run with one
tokenizer thread (RAYON_NUM_THREADS=1), so "one process" means one core; rounds alternate baseline
and candidates.

Usage: python -m bench.tokenize_speed [--rounds 3] [--mb 12] [--skip-first-step]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import replace
from pathlib import Path

os.environ["RAYON_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402

from bench.common import alternate  # noqa: E402
from qgtrain.config import DataConfig  # noqa: E402
from qgtrain.data.cache.prepare import prepare  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def make_data(folder: Path, megabytes: float, shards: int = 8) -> list[Path]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    budget, docs = int(megabytes * 1e6), []
    for path in files:
        text = path.read_text(errors="replace")
        docs.append(text)
        budget -= len(text)
        if budget <= 0:
            break
    paths = [folder / f"shard-{i:02}.jsonl" for i in range(shards)]
    for i, path in enumerate(paths):
        path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs[i::shards]))
    return paths


def make_tokenizer(folder: Path, sample: list[Path]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=["<|endoftext|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = (json.loads(line)["text"] for path in sample for line in path.open())
    tok.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def plain_loop(paths: list[Path], tokenizer_dir: Path, out: Path) -> None:
    """What a user writes first: read each line, encode batches of documents, append ids and EOS."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    eos = tok.token_to_id("<|endoftext|>")
    with open(out, "wb") as sink:
        for path in paths:
            with open(path) as lines:
                docs = [json.loads(line)["text"] for line in lines]
            for start in range(0, len(docs), 256):
                for enc in tok.encode_batch(docs[start : start + 256], add_special_tokens=False):
                    sink.write(np.asarray(enc.ids + [eos], dtype=np.uint16).tobytes())


def tokenization(work: Path, rounds: int, megabytes: float) -> None:
    paths = make_data(work, megabytes)
    size = sum(p.stat().st_size for p in paths)
    tokenizer_dir = make_tokenizer(work / "tok", paths[:2])
    cpus = len(os.sched_getaffinity(0))
    data = DataConfig(
        name="files",
        files=(str(work / "shard-*.jsonl"),),
        tokenizer=str(tokenizer_dir),
        val_fraction=0.0,
        test_fraction=0.0,
    )
    counts = sorted({1, 2, cpus})

    def ours(workers: int) -> None:
        cache = work / f"cache-{workers}"
        shutil.rmtree(cache, ignore_errors=True)
        prepare(replace(data, cache_dir=str(cache)), workers)

    candidates = {"plain loop": lambda: plain_loop(paths, tokenizer_dir, work / "plain.bin")}
    candidates.update({f"qgtrain, {n} process(es)": (lambda n=n: ours(n)) for n in counts})
    times = alternate(candidates, rounds, warmup=0)
    ours_1 = np.fromfile(next((work / "cache-1").glob("files-*/train.bin")), dtype=np.uint16)
    assert np.array_equal(ours_1, np.fromfile(work / "plain.bin", dtype=np.uint16)), (
        "different tokens"
    )
    med = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"tokenization of {size / 1e6:.1f} MB of jsonl ({len(ours_1):,} tokens), {rounds} rounds, "
        "medians:"
    )
    for name, seconds in med.items():
        print(
            f"  {name}: {seconds:.2f} s, {size / 1e6 / seconds:.2f} MB/s, throughput against the "
            f"plain loop {med['plain loop'] / seconds:.3f}"
        )
    print(f"  (goal: >= 0.9 at one process; {cpus} CPUs here)")


def first_step(work: Path, rounds: int) -> None:
    """Seconds from process start to the end of the first step, built-in corpus against a prepared
    files cache. Two steps, so that the first does not carry the final evaluation (whose cost
    depends on the data size)."""
    docs = work / "docs.jsonl"
    sources = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:400]
    docs.write_text(
        "".join(json.dumps({"text": p.read_text(errors="replace")}) + "\n" for p in sources)
    )
    common = [
        "train.max_steps=2",
        "logging.tensorboard=false",
        "checkpoint.every_steps=0",
        "train.eval_every=0",
        "train.eval_batches=1",
        f"data.cache_dir={work / 'data'}",
    ]
    setups = {
        "built-in corpus": ["data.name=corpus"],
        "data files": ["data.name=files", f"data.files=[{docs}]"],
    }
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    times: dict[str, list[float]] = {name: [] for name in setups}
    for round_ in range(rounds + 1):
        for name, sets in setups.items():
            run = work / "runs" / f"{name.replace(' ', '-')}-{round_}"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "qgtrain",
                    "train",
                    "--config",
                    str(ROOT / "config.yaml"),
                    "--run-dir",
                    str(run),
                    "--set",
                    *common,
                    *sets,
                ],
                check=True,
                env=env,
                capture_output=True,
            )
            first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
            if round_:  # round 0 prepares both caches
                times[name].append(sum(first["startup_s"].values()))
    med = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"process start to the end of the first step, medians of {rounds}: built-in corpus "
        f"{med['built-in corpus']:.2f} s, prepared data files {med['data files']:.2f} s, "
        f"difference {med['data files'] - med['built-in corpus']:+.2f} s (goal: within 1 s)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mb", type=float, default=12.0, help="megabytes of text to tokenize")
    parser.add_argument("--skip-first-step", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokenization(Path(tmp), args.rounds, args.mb)
        if not args.skip_first_step:
            first_step(Path(tmp), args.rounds)


if __name__ == "__main__":
    main()
