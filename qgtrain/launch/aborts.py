"""A step whose ranks NCCL's watchdog took down: what srun and the run directory show, and what it
means.

On NCCL a collective that times out or breaks never raises in Python. ProcessGroupNCCL's watchdog
thread writes the Flight Recorder's dump (TORCH_NCCL_DUMP_ON_TIMEOUT) and rethrows the error in
itself, which aborts the process (TORCH_NCCL_ASYNC_ERROR_HANDLING, both set in runtime/comms.py): no
failure note is left and diagnose.peer_failure never runs. What is left is srun's line for the task,
"Aborted" or "Aborted (core dumped)" (strsignal(SIGABRT), as srun writes a task's signal), or
"Exited with exit code 134" through a wrapper that turns the signal into a status, srun's own exit
134 (128 + SIGABRT), and the dumps, <run dir>/nccl/rank_<global rank> (torch names them
TORCH_FR_DUMP_TEMP_FILE + rank: distributed/flight_recorder/components/loader.py reads the rank back
from the name the same way).

Each rank whose collective failed dumps (and asks the others through the store to dump too), so the
dumps name the ranks that were still there, and a rank without one is the first suspect. The
diagnosis is a plain function of the exits per rank and the dumps' ranks; the batch node needs no
torch for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

SIGABRT_STATUS = 128 + 6


def is_abort(how: str) -> bool:
    """Whether srun's words for how a task ended mean SIGABRT."""
    return how.startswith("Aborted") or how == f"Exited with exit code {SIGABRT_STATUS}"


def dumped_ranks(names: Iterable[str], prefix: str) -> tuple[int, ...]:
    """The ranks of the Flight Recorder dumps among `names` (file names: `prefix`<rank>)."""
    pattern = re.compile(re.escape(prefix) + r"(\d+)")
    return tuple(sorted({int(m.group(1)) for name in names if (m := pattern.fullmatch(name))}))


@dataclass(frozen=True)
class Abort:
    """What the step's end says about NCCL. kind: "collective", ranks aborted and dumps written (a
    collective timed out or broke: the machine's failure); "abort", ranks aborted without a dump
    here; "dumps", dumps written but no rank reported as aborted."""

    kind: Literal["collective", "abort", "dumps"]
    aborted: tuple[int, ...]  # the ranks srun saw die of SIGABRT; () where only srun's exit says so
    dumped: tuple[int, ...]
    silent: tuple[int, ...]  # ranks without a dump, where some rank dumped
    folder: str

    def text(self) -> str:
        aborted = f"rank(s) {_ranks(self.aborted)} aborted" if self.aborted else "the step aborted"
        trace = f"`torchfrtrace {self.folder}` says which rank stopped in which collective"
        silent = (
            f"; rank(s) {_ranks(self.silent)} left no dump: they died or hung before they "
            "could write one"
            if self.silent
            else ""
        )
        if self.kind == "collective":
            return (
                f"an NCCL collective failed or timed out, the machine's failure: {aborted} "
                "(SIGABRT, exit 134, from NCCL's watchdog); the Flight Recorder dumps of "
                f"rank(s) {_ranks(self.dumped)} are in {self.folder}: {trace}{silent}"
            )
        if self.kind == "abort":
            return (
                f"{aborted} (SIGABRT, exit 134) with no NCCL Flight Recorder dump in "
                f"{self.folder}: NCCL's watchdog where the job turned "
                "TORCH_NCCL_DUMP_ON_TIMEOUT off or sent the dumps elsewhere, or another abort "
                "in native code; the job's output holds its last words"
            )
        return (
            "an NCCL collective failed or timed out before the step ended: the Flight Recorder "
            f"dumps of rank(s) {_ranks(self.dumped)} are in {self.folder}: {trace}{silent}"
        )

    def record(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "aborted": list(self.aborted),
            "dumped": list(self.dumped),
            "silent": list(self.silent),
            "dumps": self.folder,
        }


def diagnose(
    exits: Mapping[int, str], exit_code: int, dumped: Iterable[int], world_size: int, folder: str
) -> Abort | None:
    """`exits`: rank -> how srun says it ended (the ranks srun reported); `exit_code`: srun's own;
    `dumped`: the ranks whose dump is in `folder`. None where nothing points at NCCL."""
    aborted = tuple(sorted(rank for rank, how in exits.items() if is_abort(how)))
    dumps = tuple(sorted(set(dumped)))
    if not dumps and not aborted and exit_code != SIGABRT_STATUS:
        return None
    silent = tuple(rank for rank in range(world_size) if rank not in dumps) if dumps else ()
    kind: Literal["collective", "abort", "dumps"] = (
        "dumps"
        if not (aborted or exit_code == SIGABRT_STATUS)
        else "collective"
        if dumps
        else "abort"
    )
    return Abort(kind, aborted, dumps, silent, folder)


def _ranks(ranks: tuple[int, ...]) -> str:
    """0, 2-5, 7: contiguous runs folded, as srun writes them."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
