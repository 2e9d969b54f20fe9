"""Training speed of qgtrain against the hand-written DDP loop (bench/handwritten_ddp.py),
alternated in one invocation: steps/s, time from process start to the first optimizer step, and time
spent waiting for data.

Both train the same GPT-2 on the same token file, launched the same way (one process per rank,
torchrun's variables), logging every 10 steps; qgtrain's periodic checkpoints and validations are
off so the same work is timed, and it writes TensorBoard events as config.yaml's default does. The
default is the main job's model (config.yaml: 4 layers, 128 wide) on 2 gloo ranks on the CPU;
`--preset gpt2-124m --device cuda --world 1` is GPT-2 124M's shape (12 layers, 768 wide, 1024
tokens) in bf16 with fused AdamW on one GPU (NCCL), where model FLOPs utilisation is reported too.
qgtrain runs with its own model.compile default (auto: compiled on CUDA, eager on the CPU) unless
--compile says otherwise, and the hand-written loop is compiled when qgtrain is: compared the same
way. Usage: python -m bench.train_speed [--rounds 6] [--steps 150] [--preset main|gpt2-124m]
       [--device cpu|cuda] [--world 2] [--precision fp32|bf16|fp16] [--compile [auto|true|false]]
       [--peak-tflops 989] [--batch N]
Its last line, `result {...}`, holds the medians as JSON for bench.gpu_check to judge, with every
model.compile warning qgtrain logged (a block dynamo left eager). qgtrain runs
from the installed package: `PYTHONPATH=<tree> python -m bench.train_speed` times another tree's.
`--against <tree>` puts that tree's qgtrain (a `git worktree` of an older commit, with its own
config.yaml) in the hand-written loop's place, alternated the same way: a change's cost, side by
side.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, NamedTuple

from bench.common import torchrun_env
from qgtrain.config.load import load_config
from qgtrain.data import corpus

ROOT = Path(__file__).resolve().parents[1]
# the step costs ~nothing: fixed cost
PRESETS = {
    "tiny": {"hidden": 8, "layers": 1, "heads": 1, "seq": 8, "batch": 1},
    "small": {"hidden": 128, "layers": 2, "heads": 4, "seq": 128, "batch": 8},
    "main": {"hidden": 128, "layers": 4, "heads": 4, "seq": 128, "batch": 16},
    "large": {"hidden": 256, "layers": 6, "heads": 4, "seq": 256, "batch": 16},
    "gpt2-124m": {"hidden": 768, "layers": 12, "heads": 12, "seq": 1024, "batch": 16},
}
VOCAB = 257


class Ranks(NamedTuple):
    """The processes of one launch, and where each writes its standard error."""

    procs: list[subprocess.Popen[str]]
    errors: list[IO[str]]

    def outputs(self) -> list[str]:
        """Each rank's standard output once all have exited. A rank that failed ends the benchmark
        with the end of its standard error: a reading without it would only say a file was
        missing."""
        outs = [proc.communicate()[0] for proc in self.procs]
        for rank, (proc, errors) in enumerate(zip(self.procs, self.errors)):
            errors.seek(0)
            tail = errors.read()[-3000:]
            errors.close()
            if proc.returncode != 0:
                command = " ".join(map(str, proc.args[:4]))
                raise SystemExit(f"rank {rank} of {command} exited {proc.returncode}:\n{tail}")
        return outs


def launch(
    cmd: list[str], cwd: Path, world: int, env: dict[str, str] | None = None
) -> tuple[float, Ranks]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    errors = [tempfile.TemporaryFile("w+") for _ in range(world)]
    start = time.time()
    procs = [
        subprocess.Popen(
            cmd,
            cwd=cwd,
            text=True,
            stdout=subprocess.PIPE,
            stderr=errors[r],
            env={**os.environ, **(env or {}), **torchrun_env(r, world, port)},
        )
        for r in range(world)
    ]
    return start, Ranks(procs, errors)


def measure(records: list[dict], start: float, steps: int) -> dict[str, float]:
    """Steps/s is the median over 10-step intervals after warm-up, before the last step (whose
    record qgtrain writes after its final validation and test evaluation)."""
    by_step = {r["step"]: r for r in records if "time" in r}
    marks = list(range(10, steps, 10))
    rates = [10 / (by_step[b]["time"] - by_step[a]["time"]) for a, b in zip(marks, marks[1:])]
    startup = {
        f"start: {name}": seconds for name, seconds in by_step[1].get("startup_s", {}).items()
    }
    previous = start
    # the hand-written loop's wall-clock marks
    for name, mark in by_step[1].get("marks", {}).items():
        startup[f"start: {name}"], previous = mark - previous, mark
    return {
        **startup,
        "first_step_s": by_step[1]["time"] - start,
        "steps_per_s": statistics.median(rates),
        "data_wait": statistics.mean(r["data_wait_frac"] for r in records if "data_wait_frac" in r)
        if any("data_wait_frac" in r for r in records)
        else float("nan"),
    }


def run_qgtrain(
    work: Path, args: argparse.Namespace, name: str, tree: Path = ROOT
) -> dict[str, float]:
    """qgtrain as `tree` has it (default: this one, as installed)."""
    run, shape = work / name, shape_of(args)
    start, procs = launch(
        [
            sys.executable,
            "-m",
            "qgtrain",
            "train",
            "--config",
            str(tree / "config.yaml"),
            "--run-dir",
            str(run),
            "--set",
            f"train.max_steps={args.steps}",
            "train.log_every=10",
            "train.eval_every=0",
            "train.eval_batches=1",
            "checkpoint.every_steps=0",
            f"data.cache_dir={work / 'data'}",
            "data.test_fraction=0.001",
            f"model.hidden={shape['hidden']}",
            f"model.layers={shape['layers']}",
            f"model.heads={shape['heads']}",
            f"data.seq_len={shape['seq']}",
            "model.dropout=0.0",
            f"train.batch_size={shape['batch']}",
            f"train.device={args.device}",
            f"train.precision={args.precision}",
            *([] if args.compile == "auto" else [f"model.compile={args.compile}"]),
            *args.set,
        ],
        work,
        args.world,
        None if tree == ROOT else {"PYTHONPATH": str(tree)},
    )
    procs.outputs()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return measure([r for r in records if "loss" in r], start, args.steps)


def compile_warnings(run: Path) -> set[str]:
    """The warnings qgtrain's rank 0 logged about model.compile (a block left eager, a failure),
    without their time stamps."""
    log = run / "logs" / "rank_0.log"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    return {line.split(" WARNING ", 1)[1] for line in lines if " WARNING model.compile" in line}


def run_handwritten(work: Path, args: argparse.Namespace, tokens: Path) -> dict[str, float]:
    shape = shape_of(args)
    start, procs = launch(
        [
            sys.executable,
            str(ROOT / "bench" / "handwritten_ddp.py"),
            "--tokens",
            str(tokens),
            "--steps",
            str(args.steps),
            "--log_every",
            "10",
            *[f"--{key}={value}" for key, value in shape.items()],
            f"--device={args.device}",
            f"--precision={args.precision}",
            *(["--compile"] if compiles(args) else []),
        ],
        work,
        args.world,
    )
    out = procs.outputs()[0]
    return measure(
        [json.loads(line) for line in out.splitlines() if line.startswith("{")], start, args.steps
    )


def shape_of(args: argparse.Namespace) -> dict[str, int]:
    return {**PRESETS[args.preset], **({"batch": args.batch} if args.batch else {})}


def compiles(args: argparse.Namespace) -> bool:
    """Whether qgtrain compiles the model under --compile (training/parallel/compiling.py's plan
    for one GPU or the CPU), so the hand-written loop is run the same way."""
    return args.compile == "true" or (args.compile == "auto" and args.device == "cuda")


def flops_per_token(shape: dict[str, int]) -> float:
    """Training FLOPs per token as nanoGPT and PaLM estimate them: 6 x parameters plus attention."""
    h, layers = shape["hidden"], shape["layers"]
    params = layers * (12 * h * h + 13 * h) + VOCAB * h + 2 * h
    return 6 * params + 12 * layers * h * shape["seq"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="main")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--world", type=int, default=2, help="ranks (processes) on this machine")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument(
        "--compile",
        nargs="?",
        const="true",
        default="auto",
        choices=["auto", "true", "false"],
        help="qgtrain's model.compile (bare: true; left out: its default, auto), the hand-written "
        "loop compiled alike",
    )
    parser.add_argument(
        "--peak-tflops",
        type=float,
        default=989.0,
        help="the device's dense peak for --precision, for MFU (H100 SXM bf16: 989)",
    )
    parser.add_argument(
        "--batch", type=int, default=0, help="sequences per step and rank (default: the preset's)"
    )
    parser.add_argument(
        "--set", nargs="*", default=[], help="extra qgtrain settings, e.g. train.agree_every=1000"
    )
    parser.add_argument(
        "--against",
        type=Path,
        help="a tree whose qgtrain is the baseline instead of the hand-written loop",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qgtrain-speed-"))
    cfg = load_config(
        [ROOT / "config.yaml"], [f"data.cache_dir={work / 'data'}", "data.test_fraction=0.001"]
    )
    tokens = corpus.prepare(cfg.data).path("train")
    other = f"qgtrain of {args.against}" if args.against else "hand-written"
    results: dict[str, list[dict[str, float]]] = {"qgtrain": [], other: []}
    warned: set[str] = set()
    for index in range(args.rounds):  # ABBA order: drift over the run favours neither side
        for name in ["qgtrain", other] if index % 2 == 0 else [other, "qgtrain"]:
            if name == "qgtrain":
                results[name].append(run_qgtrain(work, args, f"run{index}"))
            elif args.against:
                baseline = run_qgtrain(work, args, f"against{index}", args.against.resolve())
                results[name].append(baseline)
            else:
                results[name].append(run_handwritten(work, args, tokens))
        warned |= compile_warnings(work / f"run{index}")
        print(
            f"round {index + 1}: qgtrain {results['qgtrain'][-1]}, {other} {results[other][-1]}",
            flush=True,
        )
    med = {
        name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for name, runs in results.items()
    }
    q, h = med["qgtrain"], med[other]
    ratios = [
        a["steps_per_s"] / b["steps_per_s"] for a, b in zip(results["qgtrain"], results[other])
    ]
    shape = shape_of(args)
    tokens_per_step = shape["batch"] * shape["seq"] * args.world
    print(
        f"{args.preset} on {args.world} {args.device} rank(s), {args.precision}, "
        f"compile={args.compile} ({'compiled' if compiles(args) else 'eager'}), median of "
        f"{args.rounds} alternated rounds"
    )
    print(
        f"steps/s: qgtrain {q['steps_per_s']:.3f}, {other} {h['steps_per_s']:.3f}, ratio "
        f"{q['steps_per_s'] / h['steps_per_s']:.3f} (goal >= 0.98 on CPU, >= 0.97 on a GPU); "
        f"tokens/s: qgtrain {q['steps_per_s'] * tokens_per_step:.0f}, {other} "
        f"{h['steps_per_s'] * tokens_per_step:.0f}"
    )
    mfu = {
        name: m["steps_per_s"]
        * tokens_per_step
        * flops_per_token(shape)
        / (args.peak_tflops * 1e12 * args.world)
        for name, m in med.items()
    }
    if args.device == "cuda":
        for name, share in mfu.items():
            print(
                f"model FLOPs utilisation, {name}: {share:.1%} of {args.peak_tflops:.0f} TFLOP/s "
                "per GPU"
            )
    print(
        f"fixed cost per step: qgtrain {1e6 / q['steps_per_s']:.0f} us, {other} "
        f"{1e6 / h['steps_per_s']:.0f} us, difference "
        f"{1e6 / q['steps_per_s'] - 1e6 / h['steps_per_s']:+.0f} us per step (goal <= 1000 us; "
        f"ratio spread over rounds {min(ratios):.3f} to {max(ratios):.3f})"
    )
    print(
        f"process start to first step: qgtrain {q['first_step_s']:.2f} s, {other} "
        f"{h['first_step_s']:.2f} s, difference {q['first_step_s'] - h['first_step_s']:+.2f} s "
        "(goal within 0.3 s)"
    )
    print(f"time waiting for data: {q['data_wait']:.2%} of qgtrain's step time (goal < 1%)")
    for line in sorted(warned):
        print(f"qgtrain warned: {line}")
    for name, m in med.items():
        print(
            f"{name}'s start, medians: "
            + ", ".join(
                f"{key.removeprefix('start: ')} {value:.2f} s"
                for key, value in m.items()
                if key.startswith("start: ")
            )
        )
    sides = {"qgtrain": q, other: h}
    result = {
        "preset": args.preset,
        "batch": shape["batch"],
        "world": args.world,
        "device": args.device,
        "precision": args.precision,
        "compiled": compiles(args),
        "rounds": args.rounds,
        "ratio": q["steps_per_s"] / h["steps_per_s"],
        "tokens_per_s": {k: m["steps_per_s"] * tokens_per_step for k, m in sides.items()},
        "mfu": mfu if args.device == "cuda" else None,
        "first_step_s": {k: m["first_step_s"] for k, m in sides.items()},
        "data_wait": q["data_wait"],
        "compile_warnings": sorted(warned),
    }
    print("result " + json.dumps(result))


if __name__ == "__main__":
    main()
