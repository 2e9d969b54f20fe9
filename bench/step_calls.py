"""What a plain step calls: the qgtrain functions, and the modules they live in, whose call counts
grow with the number of steps (one CPU rank, the built-in LM, a report every step or every
--log-every, no validation or checkpoint before the end). Two runs, their loops (Trainer.fit) under
cProfile, of N and 2N steps: a function called k more times in the second is called k/N times a
step, and counts when it is called at least once a step. The count is a figure of how much of the
package a newcomer follows through one step (docs/architecture.md); with --log-every 10 (the
default train.log_every), through a step between reports. Usage: python -m bench.step_calls
[--steps 20] [--log-every 1]
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pstats
import tempfile
from pathlib import Path

import qgtrain

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "qgtrain")
PLAIN = [
    "data.name=synthetic",
    "data.seq_len=32",
    "data.synthetic_samples=4096",
    "model.hidden=32",
    "model.layers=2",
    "model.heads=2",
    "train.batch_size=4",
    "train.eval_every=0",
    "train.eval_batches=1",
    "checkpoint.every_steps=0",
    "logging.tensorboard=false",
    "data.num_workers=0",
    "train.device=cpu",
]


def calls(steps: int, folder: Path, log_every: int) -> dict[tuple[str, str], int]:
    """(module path, function) -> calls, for qgtrain's functions, over a run of `steps` steps."""
    from qgtrain.training.trainer import Trainer

    sets = [*PLAIN, f"train.max_steps={steps}", f"train.log_every={log_every}"]
    cfg = qgtrain.load_config([], sets)
    profile, fit = cProfile.Profile(), Trainer.fit

    def profiled_fit(trainer: Trainer) -> object:
        """Only the loop: not the start, nor qgtrain.train reading the metrics back after it."""
        return profile.runcall(fit, trainer)

    Trainer.fit = profiled_fit  # type: ignore[method-assign,assignment]
    try:
        qgtrain.train(cfg, run_dir=str(folder / f"run-{steps}"))
    finally:
        Trainer.fit = fit  # type: ignore[method-assign]
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return {
        (file, name): count
        for (file, _, name), (_, count, *_rest) in stats.items()
        if file.startswith(PACKAGE)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--log-every", type=int, default=1, help="train.log_every of both runs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qgtrain-step-calls-") as folder:
        short = calls(args.steps, Path(folder), args.log_every)
        long = calls(2 * args.steps, Path(folder), args.log_every)
    per_step = {
        key: (long[key] - short.get(key, 0)) / args.steps
        for key in long
        if long[key] - short.get(key, 0) >= args.steps  # at least once a step
    }
    modules: dict[str, list[str]] = collections.defaultdict(list)
    for (file, name), times in sorted(per_step.items()):
        module = Path(file).relative_to(ROOT).with_suffix("").as_posix().replace("/", ".")
        modules[module].append(f"{name} x{times:g}")
    for module, functions in modules.items():
        print(f"{module}: {', '.join(functions)}")
    print(
        f"a plain step calls {len(per_step)} functions of {len(modules)} qgtrain modules "
        f"(steps {args.steps} and {2 * args.steps}, a report every {args.log_every})"
    )


if __name__ == "__main__":
    main()
