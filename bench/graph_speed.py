"""Training speed of qgtrain on the graph classifier (jobs/graph.yaml) against the hand-written DDP
loop (bench/handwritten_graph.py), alternated in one invocation: steps/s and time from process start
to the first optimizer step.

The causal LM of bench/train_speed.py has fixed-shape batches from a memory-mapped file; this task
is the other kind a user brings: a dataset that builds every sample in Python, a collate that packs
graphs of varying size into a dataclass, and a model of small scatter kernels, with steps of about
10 ms on two CPU ranks, where whatever the loop adds per step shows. Both sides train the same model
from the same seed on the same shards, with the same settings (read from the resolved config and
handed to the baseline), launched the same way and measured by the same code as train_speed.py;
qgtrain's periodic checkpoints, validations, TensorBoard and early stopping are off so the same work
is timed, and its final validation, test and checkpoint fall after the last timed interval.
Usage: python -m bench.graph_speed [--rounds 6] [--steps 150] [--device cpu|cuda] [--world 2]
       [--precision fp32|bf16] [--set train.agree_every=10 ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.train_speed import launch, measure
from qgtrain.config import RunConfig
from qgtrain.config.load import load_config

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [ROOT / "config.yaml", ROOT / "jobs" / "graph.yaml"]


def settings(args: argparse.Namespace) -> list[str]:
    """qgtrain's overrides: the timed steps do nothing but train (eval_every=0 validates only after
    the last step, which measure() leaves out; eval_batches=1 keeps that short)."""
    return [
        f"train.max_steps={args.steps}",
        "train.log_every=10",
        "train.eval_every=0",
        "train.eval_batches=1",
        "checkpoint.every_steps=0",
        "logging.tensorboard=false",
        "early_stopping.patience=0",
        f"train.device={args.device}",
        f"train.precision={args.precision}",
        *args.set,
    ]


def baseline_args(cfg: RunConfig, args: argparse.Namespace) -> list[str]:
    """The hand-written loop's settings, from the same resolved config qgtrain trains with."""
    t, o, options = cfg.train, cfg.optim, cfg.task.options
    values = {
        "steps": t.max_steps,
        "log_every": t.log_every,
        "batch": t.batch_size,
        "graphs": options["graphs"],
        "hidden": options["hidden"],
        "layers": options["layers"],
        "seed": t.seed,
        "lr": o.lr,
        "min_lr": o.min_lr,
        "warmup": o.warmup_steps,
        "weight_decay": o.weight_decay,
        "beta1": o.beta1,
        "beta2": o.beta2,
        "eps": o.eps,
        "grad_clip": o.grad_clip,
        "device": args.device,
        "precision": args.precision,
    }
    return [f"--{key}={value}" for key, value in values.items()]


def run_qgtrain(work: Path, args: argparse.Namespace, name: str) -> dict[str, float]:
    run = work / name
    configs = [arg for path in CONFIGS for arg in ("--config", str(path))]
    start, procs = launch(
        [
            sys.executable,
            "-m",
            "qgtrain",
            "train",
            *configs,
            "--run-dir",
            str(run),
            "--set",
            *settings(args),
        ],
        ROOT,
        args.world,
    )
    procs.outputs()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return measure([r for r in records if "loss" in r], start, args.steps)


def run_handwritten(args: argparse.Namespace, cfg: RunConfig) -> dict[str, float]:
    start, procs = launch(
        [sys.executable, str(ROOT / "bench" / "handwritten_graph.py"), *baseline_args(cfg, args)],
        ROOT,
        args.world,
    )
    # every rank waited for; rank 0 prints the records
    outs = procs.outputs()
    return measure(
        [json.loads(line) for line in outs[0].splitlines() if line.startswith("{")],
        start,
        args.steps,
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--world", type=int, default=2, help="ranks (processes) on this machine")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument(
        "--set", nargs="*", default=[], help="extra qgtrain settings, e.g. train.agree_every=10"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qgtrain-graph-speed-"))
    cfg = load_config(CONFIGS, settings(args))
    results: dict[str, list[dict[str, float]]] = {"qgtrain": [], "hand-written": []}
    for index in range(args.rounds):  # ABBA order: drift over the run favours neither side
        for name in ["qgtrain", "hand-written"] if index % 2 == 0 else ["hand-written", "qgtrain"]:
            results[name].append(
                run_qgtrain(work, args, f"run{index}")
                if name == "qgtrain"
                else run_handwritten(args, cfg)
            )
        print(
            f"round {index + 1}: qgtrain {results['qgtrain'][-1]}, hand-written "
            f"{results['hand-written'][-1]}",
            flush=True,
        )
    med = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in results.items()
    }
    q, h = med["qgtrain"], med["hand-written"]
    ratios = [
        a["steps_per_s"] / b["steps_per_s"]
        for a, b in zip(results["qgtrain"], results["hand-written"])
    ]
    samples_per_step = cfg.train.batch_size * args.world
    print(
        f"graph classifier on {args.world} {args.device} rank(s), {args.precision}, median of "
        f"{args.rounds} alternated rounds"
    )
    print(
        f"steps/s: qgtrain {q['steps_per_s']:.3f}, hand-written {h['steps_per_s']:.3f}, ratio "
        f"{q['steps_per_s'] / h['steps_per_s']:.3f} (goal >= 0.97); samples/s: qgtrain "
        f"{q['steps_per_s'] * samples_per_step:.0f}, hand-written "
        f"{h['steps_per_s'] * samples_per_step:.0f}"
    )
    print(
        f"time per step: qgtrain {1e6 / q['steps_per_s']:.0f} us, hand-written "
        f"{1e6 / h['steps_per_s']:.0f} us, difference "
        f"{1e6 / q['steps_per_s'] - 1e6 / h['steps_per_s']:+.0f} us per step (ratio spread over "
        f"rounds {min(ratios):.3f} to {max(ratios):.3f})"
    )
    print(
        f"process start to first step: qgtrain {q['first_step_s']:.2f} s, hand-written "
        f"{h['first_step_s']:.2f} s, difference {q['first_step_s'] - h['first_step_s']:+.2f} s "
        "(goal within 1 s)"
    )
    print(
        f"time waiting for data: {q['data_wait']:.2%} of qgtrain's step time (graphs are built in "
        "the rank's own process on both sides: data.num_workers=0)"
    )


if __name__ == "__main__":
    main()
