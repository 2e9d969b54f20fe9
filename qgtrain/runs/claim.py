"""The run directory, claimed for one start of a run: rank 0 picks it and holds its lock, every rank
checks the checkpoint it may resume from, and only then is the start recorded, so a refused start
changes nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import RunConfig
from ..config.load import dump_yaml
from ..foundation.errors import QgtrainError
from ..foundation.pinned import Pinned
from ..runtime import distributed
from ..runtime.rendezvous import DistEnv
from ..state import verify_ranks
from ..state.resume import Candidates, resume_candidates
from ..state.storage import Storage
from . import rundir
from .rundir import RunDir


@dataclass(frozen=True)
class Claim:
    """Rank 0's decision about the run directory, the same on every rank."""

    path: Path  # absolute, as rank 0 sees it
    run_id: str
    resume_from: str | None  # the checkpoint to resume from
    warnings: list[str]  # logged once the run's log file is open
    # what it may resume from, before the ranks check the files
    candidates: Candidates = Candidates([], [])
    pinned: tuple[int, int] = (0, 0)  # the device and inode of the folder rank 0 checked

    @property
    def run(self) -> RunDir:
        return RunDir(self.path)


def pinned_here(claim: Claim, is_main: bool) -> Pinned:
    """The run folder as this rank holds it: rank 0's is the folder it checked; another rank's (a
    device is numbered per node) is the one its path names once rank 0 has checked it."""
    return Pinned(claim.path, *claim.pinned) if is_main else Pinned.now(claim.path)


def claimed(
    cfg: RunConfig,
    env: DistEnv,
    device: torch.device,
    run_dir: Path | None,
    held: contextlib.ExitStack,
) -> Claim:
    """Every rank: the claimed run directory and the checkpoint to resume from (collectives)."""
    found = _received(distributed.main_decides(lambda: _sent(_claim(cfg, env, run_dir, held))))
    resume_from, skipped = verify_ranks.choose(found.candidates, RunDir(found.path).checkpoints)
    claim = _received(
        distributed.main_decides(lambda: _sent(_open(cfg, found, resume_from, skipped)))
    )
    _check_shared(claim, env, device)
    return claim


def _sent(claim: Claim) -> dict[str, Any]:
    """A claim as ranks send each other values (runtime/objects.py): plain data, no class."""
    return {**dataclasses.asdict(claim), "path": str(claim.path)}


def _received(sent: dict[str, Any]) -> Claim:
    return Claim(
        **{**sent, "path": Path(sent["path"]), "candidates": Candidates(**sent["candidates"])}
    )


def _claim(cfg: RunConfig, env: DistEnv, run_dir: Path | None, held: contextlib.ExitStack) -> Claim:
    """Rank 0 picks the directory (one only the user can write: require_safe), holds its lock while
    training, and lists the checkpoints it may resume from before it writes anything there: a
    refusal leaves the run as it was."""
    path = (run_dir or rundir.default_run_dir(cfg)).resolve()
    warnings: list[str] = []
    try:
        checked = rundir.require_safe(path, warnings.append)
        rundir.refuse_foreign(path)
        exposed = rundir.create(path, cfg.logging.shared)
        held.enter_context(
            rundir.exclusive(path, f"Slurm job {env.job_id}" if env.job_id else "qgtrain")
        )
        # the folder checked, still there; one made just now is checked now
        pin = checked or rundir.require_safe(path, lambda _: None) or Pinned.now(path)
        pin.check()
        warnings += [exposed] if exposed else []
        storage = Storage(RunDir(path).checkpoints, rundir.read_run_id(path))
        candidates = resume_candidates(storage, cfg.checkpoint.resume, warnings.append)
        return Claim(path, "", None, warnings, candidates, (pin.device, pin.inode))
    except OSError as exc:
        raise rundir.unwritable(path, exc) from None


def _open(cfg: RunConfig, claim: Claim, resume_from: str | None, skipped: list[str]) -> Claim:
    """Rank 0 records the start once the ranks agree on the checkpoint (verify_ranks.py)."""
    try:
        run_id = rundir.open_run(claim.path, cfg, dump_yaml(cfg))
    except OSError as exc:
        raise rundir.unwritable(claim.path, exc) from None
    return dataclasses.replace(
        claim, run_id=run_id, resume_from=resume_from, warnings=claim.warnings + skipped
    )


def _check_shared(claim: Claim, env: DistEnv, device: torch.device) -> None:
    """Every rank must see the run directory rank 0 just claimed: checkpoints are written into one
    folder by all ranks. Checked before anything is built, on every rank (a collective)."""
    blind = distributed.flagged_ranks(rundir.read_run_id(claim.path) != claim.run_id, device)
    if blind:
        raise QgtrainError(
            f"rank(s) {blind} do not see the run directory {claim.path} that rank 0 created on "
            f"{env.master_addr}: each node sees its own folder at that path. HINT: the run "
            "directory must be on a filesystem every node mounts (a shared filesystem); point "
            "logging.runs_dir or --run-dir there (`srun qgtrain doctor` checks)"
        )
