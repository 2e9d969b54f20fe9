"""torch.compile's caches kept in the run directory, so a requeued job does not compile everything
again.

Inductor and Triton cache compiled kernels under /tmp by default: node-local, often wiped, and a
requeued job usually lands on another node, where it compiled from scratch (most of its start:
bench.compile_restart measures it). With model.compile each rank keeps its cache in <run
dir>/compile-cache/rank-N, on the shared filesystem, where the next start of the same rank finds it.
torch's portable cache artifacts (save/load_cache_artifacts) were measured too: on the CPU they
carry the graphs but not the compiled C++, and saved little of the start.

The folder is offered for the whole training (`in_run_dir`) but taken only when something is
compiled (`claim`, from training/compiling.py): with `model.compile: auto` a CPU run compiles
nothing, and should neither make the folder nor import inductor's utilities (a second of start).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path


class _Offer:
    def __init__(self, folder: Path, undo: contextlib.ExitStack) -> None:
        self.folder, self.undo, self.claimed = folder, undo, False


# the folders offered by the enclosing in_run_dir blocks, innermost last
_offered: list[_Offer] = []


@contextlib.contextmanager
def in_run_dir(run_dir: Path, rank: int) -> Iterator[Path]:
    """Offer <run dir>/compile-cache/rank-<rank> to whatever compiles within the block."""
    folder = run_dir / "compile-cache" / f"rank-{rank}"
    with contextlib.ExitStack() as undo:
        offer = _Offer(folder, undo)
        _offered.append(offer)
        try:
            yield folder
        finally:
            _offered.remove(offer)


def claim() -> Path | None:
    """Point inductor's caches at the offered folder (once; None where none is offered)."""
    if not _offered:
        return None
    offer = _offered[-1]
    if not offer.claimed:
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        offer.folder.mkdir(parents=True, exist_ok=True)
        offer.undo.enter_context(temporary_cache_dir(str(offer.folder)))
        offer.claimed = True
        logging.getLogger("qgtrain").info(
            "torch.compile caches in %s, for the next start of this rank", offer.folder
        )
    return offer.folder
