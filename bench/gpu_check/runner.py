"""`qgtrain` run in this process with what the check needs set first: deterministic algorithms where
two runs are compared for equality, and CUDA's sync debug mode around the steps that must not wait
for the GPU. Used as `[torchrun ...] -m bench.gpu_check.runner [--deterministic] [--quiet STEPS] --
qgtrain args`.

Deterministic: torch.use_deterministic_algorithms(True, warn_only=True) (torch/__init__.py: ops
without a deterministic kernel warn instead of failing the run, and their warning is counted), with
CUBLAS_WORKSPACE_CONFIG=:4096:8 set by the caller before CUDA starts.

Quiet steps: torch.cuda.set_sync_debug_mode("warn") from the start of each step in the set to the
end of its update (the trainer's StepTimer.start_step and training_done), default mode elsewhere:
logging steps, checkpoints and validations may sync. The mode is checked where torch copies to
pageable memory or waits for a stream or the device (c10/cuda/CUDAFunctions.h memcpy_and_sync,
stream_synchronize: `.item()`, `.tolist()`, `.cpu()`, `torch.cuda.synchronize()`), not at
cudaEventSynchronize (c10/cuda/impl/CUDAGuardImpl.h synchronizeEvent), nor in torch.distributed
(its docstring): a blocking collective wait is not seen. Each warning is counted against its step; a
deliberate `.item()` first proves the watch sees one. Written to `syncs.json` in the directory given
by QGTRAIN_CHECK_OUT.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

SYNC_WARNING = "synchroniz"  # c10's "called a synchronizing CUDA operation"


class SyncWatch:
    def __init__(self, quiet: set[int]) -> None:
        self.quiet, self.step, self.current = quiet, 0, 0
        self.by_step: dict[int, int] = {}
        self.nondeterministic: list[str] = []

    def seen(self, message: str) -> None:
        if SYNC_WARNING in message and self.current:
            self.by_step[self.current] = self.by_step.get(self.current, 0) + 1
        elif "deterministic" in message and message not in self.nondeterministic:
            self.nondeterministic.append(message[:200])

    def listen(self) -> None:
        """Count the warnings torch raises: sync warnings by step, nondeterministic kernels by
        message."""
        watch, shown = self, warnings.showwarning

        def showwarning(message: Any, *args: Any, **kwargs: Any) -> None:
            watch.seen(str(message))
            shown(message, *args, **kwargs)

        warnings.showwarning = showwarning
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}.*")

    def install(self) -> None:
        import torch

        from qgtrain.training import assembly, timing

        watch, base = self, timing.StepTimer

        class WatchedTimer(base):  # type: ignore[misc, valid-type]
            def restart(self, step: int) -> None:
                watch.step = step
                super().restart(step)

            def start_step(self) -> None:
                watch.step += 1
                if watch.step in watch.quiet:
                    watch.current = watch.step
                    torch.cuda.set_sync_debug_mode("warn")
                super().start_step()

            def training_done(self, step: int) -> None:
                super().training_done(step)
                torch.cuda.set_sync_debug_mode("default")
                watch.current = 0

        assembly.StepTimer = WatchedTimer  # type: ignore[misc]

    def self_test(self) -> bool:
        """Whether a deliberate `.item()` under the watch is seen (else a clean result proves
        nothing)."""
        import torch

        self.current = -1
        torch.cuda.set_sync_debug_mode("warn")
        torch.ones(1, device="cuda").item()
        torch.cuda.set_sync_debug_mode("default")
        self.current = 0
        return self.by_step.pop(-1, 0) > 0


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deterministic", action="store_true")
    parser.add_argument(
        "--quiet", default="", help="first:last steps to watch for syncs (CUDA only)"
    )
    parser.add_argument("qgtrain", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    import torch

    from qgtrain.interface.cli import main as qgtrain_main

    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    first, last = (int(v) for v in args.quiet.split(":")) if args.quiet else (0, -1)
    watch = SyncWatch(set(range(first, last + 1)))
    watch.listen()
    sees = False
    if args.quiet:
        watch.install()
        sees = watch.self_test()
    code = qgtrain_main([a for a in args.qgtrain if a != "--"])
    out = os.environ.get("QGTRAIN_CHECK_OUT")
    if out and os.environ.get("RANK", "0") == "0":
        Path(out, "syncs.json").write_text(
            json.dumps(
                {
                    "watch_sees_syncs": sees,
                    "quiet": [first, last],
                    "syncs_by_step": watch.by_step,
                    "nondeterministic": watch.nondeterministic,
                }
            )
        )
    return int(code or 0)


if __name__ == "__main__":
    sys.exit(main())
