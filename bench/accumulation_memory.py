"""Gradient accumulation under fsdp: peak memory with 4 micro-batches against 1, qgtrain's way
against the way before (every micro-batch but the last kept FSDP2 from reducing, so each rank held
every parameter's unsharded gradient until the last one).

Per rank: peak RSS growth (VmHWM from /proc) over the rank's RSS once the model is sharded and its
optimizer made, through two optimizer steps, on a GPT-2 of --layers x --hidden (24 x 1024: 302.6M
parameters, 1.2 GB in fp32) at 2 gloo ranks, with glibc's malloc set up as a training rank sets it
(runtime/cpu.py). The same happens on a GPU with its memory.

Usage: python -m bench.accumulation_memory [--layers 24 --hidden 1024]
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

import torch

from bench.big_model import spawn, status_bytes


def step_rank(env: Any, sets: list[str], micro: int, deferred: bool) -> dict[str, float]:
    from qgtrain.config.load import load_config
    from qgtrain.runtime import cpu as cpu_use
    from qgtrain.runtime import rng
    from qgtrain.tasks.build import build_task
    from qgtrain.training.optimizers import adamw
    from qgtrain.training.parallel.step import accumulate_gradients, apply_update
    from qgtrain.training.parallel.strategy import strategy_for

    cfg, cpu = load_config([], sets), torch.device("cpu")
    cpu_use.keep_freed_memory()  # as a training rank does (run.py): freed blocks are kept for reuse
    rng.seed_everything(cfg.train.seed)
    strategy = strategy_for(cfg.train, env, cpu)
    model = build_task(cfg, empty=strategy.builds_empty(True)).model
    model._apply(lambda t: torch.empty_like(t, device=cpu) if t.is_meta else t)
    strategy.wrap(model, False, "fp32")
    optimizer, scaler = adamw(model, cfg.optim, cpu), torch.amp.GradScaler("cpu", enabled=False)
    before = status_bytes("VmRSS:")
    batches = [
        torch.randint(0, 257, (1, 16), generator=torch.Generator().manual_seed(env.rank + i))
        for i in range(micro)
    ]
    for _ in range(2):
        with _deferred_reduction(model, micro) if deferred else contextlib.nullcontext():
            accumulate_gradients(model, _loss, batches, "fp32", scaler, cpu, strategy=strategy)
        apply_update(optimizer, scaler, torch.tensor(False))
        optimizer.zero_grad(set_to_none=True)
    return {"peak": (status_bytes("VmHWM:") - before) / 1e6}


def _loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss


@contextlib.contextmanager
def _deferred_reduction(model: Any, micro: int) -> Any:
    """The way before: no reduce-scatter until the last micro-batch (set_requires_gradient_sync),
    done here by a pre-forward hook counting the micro-batches of the step."""
    seen = [0]

    def before_forward(*_: Any) -> None:
        seen[0] += 1
        model.set_requires_gradient_sync(seen[0] == micro)

    handle = model.register_forward_pre_hook(before_forward)
    try:
        yield
    finally:
        handle.remove()
        model.set_requires_gradient_sync(True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    sets = [
        f"model.layers={args.layers}",
        f"model.hidden={args.hidden}",
        "model.heads=16",
        "data.name=synthetic",
        "data.seq_len=16",
        "data.synthetic_samples=64",
        "train.parallel=fsdp",
    ]
    print(
        f"GPT-2 {args.layers} x {args.hidden}, 2 gloo ranks, fsdp; peak RSS growth per rank over "
        "two steps, MB (rank 0 / rank 1)"
    )
    peaks = {}
    for name, deferred in (
        ("qgtrain (reduce-scatter every micro-batch)", False),
        ("before (reduce at the last micro-batch)", True),
    ):
        for micro in (1, 4):
            got = spawn(2, step_rank, sets, micro, deferred)
            peaks[name, micro] = max(got[r]["peak"] for r in got)
            print(f"  {name}, {micro} micro-batch(es): {got[0]['peak']:.0f} / {got[1]['peak']:.0f}")
        grown = peaks[name, 4] - peaks[name, 1]
        print(f"  {name}: 4 micro-batches cost {grown:+.0f} MB over 1 (goal: within 150 MB)")


if __name__ == "__main__":
    main()
