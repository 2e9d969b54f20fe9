"""torch.compile's caches kept in the run directory, so a requeued job does not compile everything
again.

Inductor and Triton cache compiled kernels under /tmp by default: node-local, often wiped, and a
requeued job usually lands on another node, where it compiled from scratch (most of its start:
bench.compile_restart measures it). With model.compile each rank keeps its cache in <run
dir>/compile-cache/rank-N, on the shared filesystem, where the next start of the same rank finds it.
torch's portable cache artifacts (save/load_cache_artifacts) were measured too: on the CPU they
carry the graphs but not the compiled C++, and saved little of the start.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def in_run_dir(run_dir: Path, rank: int) -> Iterator[Path]:
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    folder = run_dir / "compile-cache" / f"rank-{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    logging.getLogger("qgtrain").info(
        "torch.compile caches in %s, for the next start of this rank", folder
    )
    with temporary_cache_dir(str(folder)):
        yield folder
