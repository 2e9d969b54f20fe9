"""Checking the checkpoint a start resumes from on every rank at once, each rank its share of the
files.

Rank 0 picks the candidates from manifests and file sizes (resume.py). Then every rank checksums its
share of the newest candidate's files, all in parallel, and the ranks agree before any state is
touched: if any rank found a damaged file, every rank passes to the candidate before it, with a
warning naming the file and the rank, exactly as when one process checked everything. A rank's share
is the files it reads next: its own rank file and its own shard file (`rank-N.pt`,
`sharded/__N_0.distcp`: on the same layout each rank restores its own shard), so the checksums warm
the page cache for the load. Files every rank reads or none owns (`model.pt` and `optim.pt` of a ddp
checkpoint, the shards of ranks that no longer exist, the small files) are checked by one rank each,
the largest first to the rank with least to read.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist

from ..foundation.errors import CheckpointError, QgtrainError
from ..runtime import distributed, objects
from .checkpoint import Checkpoint, read_manifest, verify
from .layout import MANIFEST, OWN_FILE
from .manifest_files import listing_problem
from .resume import Candidates, refusal, resume_candidates
from .storage import Storage

log = logging.getLogger("qgtrain")


def assign(sizes: Mapping[str, int], world_size: int) -> list[list[str]]:
    """The files each rank checks: its own where it exists, the others by size to the least loaded
    rank."""
    shares: list[list[str]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    rest = []
    for name, size in sizes.items():
        own = OWN_FILE.fullmatch(name)
        writer = int(own.group(1) or own.group(2)) if own else world_size
        if writer < world_size:
            shares[writer].append(name)
            load[writer] += size
        else:
            rest.append(name)
    for name in sorted(rest, key=lambda n: (-sizes[n], n)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        shares[rank].append(name)
        load[rank] += sizes[name]
    return shares


def choose(candidates: Candidates, root: Path) -> tuple[str | None, list[str]]:
    """The checkpoint to resume from, the same on every rank (a collective), and the warnings for
    the candidates passed over. Raises on every rank when candidates existed and none verifies."""
    warnings: list[str] = []
    problems = list(candidates.problems)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    for path in map(Path, candidates.paths):
        mine = _check_share(path, rank, world_size)
        everyone: list[tuple[str | None, bool]] = objects.all_gather(mine, what="check")
        blind = [r for r, (_, missing) in enumerate(everyone) if missing]
        if blind:
            raise QgtrainError(
                f"rank(s) {blind} do not see {path}, which rank 0 found: each node sees its own "
                "folder at that path. HINT: the run directory must be on a filesystem every node "
                "mounts (a shared filesystem); point logging.runs_dir or --run-dir there"
            )
        found = [(r, problem) for r, (problem, _) in enumerate(everyone) if problem]
        if not found:
            return str(path), warnings
        said = f"{found[0][1]} (found by rank {found[0][0]})"
        if candidates.named:
            raise CheckpointError(f"checkpoint.resume: {said}")
        warnings.append(f"skipping checkpoint {path.name}: {said}; trying the one before it")
        problems.append(f"{path.name}: {said}")
    if problems:
        raise refusal(root, problems)
    return None, warnings


def newest_intact(storage: Storage, step: int) -> Checkpoint | None:
    """The run's newest checkpoint at or before `step` whose files every rank finds intact, found
    as a start finds the one it resumes from (rank 0 lists, every rank checks its share); damaged
    ones are passed over with a warning. A collective: a rollback's way back."""

    def listed() -> Candidates:
        found = resume_candidates(storage, "auto", log.warning)
        kept = [path for path in found.paths if (c := read_manifest(Path(path))) and c.step <= step]
        return dataclasses.replace(found, paths=kept, problems=[])

    # as plain data: ranks send each other no class (runtime/objects.py)
    found = Candidates(**distributed.main_decides(lambda: dataclasses.asdict(listed())))
    path, passed_over = choose(found, storage.root)
    for warning in passed_over if dist.get_rank() == 0 else []:
        log.warning("%s", warning)
    return read_manifest(Path(path)) if path is not None else None


def _check_share(path: Path, rank: int, world_size: int) -> tuple[str | None, bool]:
    """(what is wrong with this rank's share of the files, or None; whether the folder is not
    there)."""
    if not path.is_dir():
        return None, True
    ckpt = read_manifest(path)
    if ckpt is None:
        return f"{path / MANIFEST} cannot be read", False
    problem = listing_problem(ckpt.manifest, path / MANIFEST)  # before its names and sizes are used
    if problem is None:
        sizes = {name: int(entry["size"]) for name, entry in ckpt.manifest.get("files", {}).items()}
        problem = verify(ckpt, assign(sizes, world_size)[rank])
    if problem:
        log.warning("rank %d found a damaged file: %s", rank, problem)
    return problem, False
