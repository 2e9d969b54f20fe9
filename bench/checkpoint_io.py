"""Checkpoint save and load, qgtrain against plain torch.save/torch.load of the same state.

qgtrain's side is the real path: a (one-rank) process group, Checkpointer.save with its staging
folder, checksums, fsync, manifest and rename, then choose() (which verifies checksums) and loading
into a model and optimizer. The baseline saves the same model and optimizer state dicts with
torch.save and loads them back into the same objects. Like qgtrain (keep_last=2), it writes a new
file per save and deletes the one before last: overwriting a single file reuses the pages it has
just freed, which on a VM is measurably cheaper than writing fresh ones and would compare unlike
with like. Usage: python -m bench.checkpoint_io [--params-m 25] [--repeats 7] [--async-save] [--dir
/dev/shm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from bench.common import alternate, report
from qgtrain.config import CheckpointConfig
from qgtrain.runtime.distributed import process_group
from qgtrain.runtime.rendezvous import DistEnv
from qgtrain.state import checkpoint, verify_ranks
from qgtrain.state.checkpointer import Checkpointer
from qgtrain.state.resume import resume_candidates


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--params-m", type=float, default=25.0, help="model size in millions of parameters"
    )
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--async-save", action="store_true", help="also time the stall of an async save"
    )
    parser.add_argument(
        "--dir",
        default=None,
        help="where to write (default: a temporary folder; /dev/shm "
        "isolates the software cost from the disk)",
    )
    args = parser.parse_args()
    width = 1024
    layers = max(1, round(args.params_m * 1e6 / (width * width)))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()
    size_mb = sum(p.numel() for p in model.parameters()) * 4 * 3 / 1e6
    print(f"state: {layers} x Linear({width}, {width}), model + AdamW state {size_mb:.0f} MB")
    root = Path(tempfile.mkdtemp(prefix="qgtrain-bench-", dir=args.dir))
    print(f"writing to {root}")
    env = DistEnv()
    with process_group(env, torch.device("cpu"), 60, 600):
        saver = Checkpointer(root / "checkpoints", "bench", env, CheckpointConfig(keep_last=2))
        step = iter(range(1, 10**6))

        def qgtrain_save() -> None:
            saver.save(
                next(step),
                lambda: {"model.pt": model.state_dict(), "optim.pt": optimizer.state_dict()},
                {"rng": torch.get_rng_state()},
                {},
            )

        plain_written: list[Path] = []

        def plain_save(fsync: bool = False) -> None:
            path = root / f"plain-{len(plain_written)}.pt"
            with open(path, "wb") as f:
                torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, f)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())
            plain_written.append(path)
            if len(plain_written) > 2:
                plain_written[-3].unlink()

        def qgtrain_load() -> None:
            chosen, _ = verify_ranks.choose(
                resume_candidates(saver.storage, "auto", print), saver.storage.root
            )
            ckpt = checkpoint.read_manifest(Path(str(chosen)))
            assert ckpt is not None
            model.load_state_dict(checkpoint.load_file(ckpt, "model.pt"))
            optimizer.load_state_dict(checkpoint.load_file(ckpt, "optim.pt"))

        def plain_load() -> None:
            state = torch.load(plain_written[-1], weights_only=True)
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])

        def settle() -> None:
            """Untimed: background fsync and rotation finish (as between real saves), and every
            dirty page is written, so neither side inherits the other's writeback throttling."""
            saver.wait()
            os.sync()

        saves = alternate(
            {"qgtrain save": qgtrain_save, "torch.save": plain_save}, args.repeats, settle=settle
        )
        loads = alternate(
            {"qgtrain load": qgtrain_load, "torch.load": plain_load}, args.repeats, settle=settle
        )
        report("save (training stall)", saves, "qgtrain save", "torch.save", "<= 1.1")
        report("load (verified)", loads, "qgtrain load", "torch.load", "<= 1.1")
        durable = alternate(
            {
                "qgtrain durable save": lambda: (qgtrain_save(), saver.wait()),
                "torch.save + fsync": lambda: plain_save(fsync=True),
            },
            args.repeats,
            settle=settle,
        )
        report("durable save", durable, "qgtrain durable save", "torch.save + fsync", "reported")
        if args.async_save:

            def save_with(async_save: bool) -> Callable[[], None]:
                def timed() -> None:
                    saver.async_save = async_save
                    qgtrain_save()

                return timed

            stalls = alternate(
                {"async save stall": save_with(True), "sync save stall": save_with(False)},
                args.repeats,
                settle=settle,
            )
            report("async checkpoint", stalls, "async save stall", "sync save stall", "<= 0.2")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
