"""After a training step (srun) failed inside a batch job: try again in this allocation, requeue, or
end.

train.slurm runs `qgtrain recover` when srun exits with a failure. What the failure left behind
decides: srun's own report of the first task that failed (node, rank, how it ended), the notes
failing ranks left in the run directory (qgtrain/runs/lifecycle.py: a message, and whether it was
the machine's failure or the run's own), NCCL's aborts and Flight Recorder dumps (aborts.py: a rank
NCCL's watchdog took down leaves no note), and the run's history of failures per node. The answer is
one line the script acts on:

    retry [NODE [N]]       a new srun step in this allocation, from the last committed checkpoint
                           (without NODE, on a spare node: slurm.spare_nodes; or on N nodes, with
                           the global batch kept: slurm.min_nodes)
    requeue [NODE[,NODE]]  requeue the job, keeping it away from these nodes
    end                    the run's own failure (a new attempt would fail the same way), or
                           nothing left

Each failure is recorded in status.json, so `qgtrain runs` shows the retries and their causes. No
torch is imported: the answer comes at once on the batch node.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..config import SlurmConfig
from ..config.slurm import shrinks
from ..foundation.errors import EXIT_REQUEUE_ME, EXIT_STOPPED
from ..runs import rundir
from ..runs.lifecycle import read_note
from . import aborts, failures, suspects
from .srun_log import TaskFailure, lost_nodes, task_failures
from .suspects import Suspect


@dataclass(frozen=True)
class Decision:
    action: Literal["retry", "requeue", "end"]
    reason: str
    exclude: tuple[str, ...] = ()
    nodes: int | None = None  # a retry on fewer nodes (slurm.min_nodes): how many

    def line(self) -> str:
        fewer = [str(self.nodes)] if self.nodes is not None else []
        return " ".join([self.action, ",".join(self.exclude), *fewer]).strip()


def decide(
    notes: dict[int, dict[str, Any]],
    failure: TaskFailure | None,
    attempt: int,
    step_retries: int,
    restart: int,
    max_restarts: int,
    requeue: bool,
    failures_per_node: dict[str, int],
    free_nodes: int | None,
    nccl: aborts.Abort | None = None,
    spares_left: int = 0,
    suspect: Suspect | None = None,
    fewer: int | None = None,
) -> Decision:
    """`notes`: rank -> {"message", "retryable"}; `attempt`: retries made in this allocation so far;
    `failures_per_node`: this run's failures so far, this one included; `free_nodes`: nodes the
    partition has beyond what the job needs (None where unknown); `nccl`: what NCCL's aborts and
    dumps say (the machine's failure, so retried like a rank that died, and named in the reason);
    `spares_left`: the allocation's spare nodes no step has left out yet; `suspect`: the node the
    failure points at (suspects.py); `fewer`: the nodes a step without it would run on, where
    slurm.min_nodes allows one (fewer_nodes).

    A failure srun places on a node is retried without that node, whatever retries are left: on a
    spare, else on fewer nodes. A spare is used once and each retry on fewer nodes leaves one out,
    so these retries are bounded too."""
    requeue_left = requeue and restart < max_restarts
    if (ended := _not_to_retry(notes, failure, requeue_left)) is not None:
        return ended
    said = f"{nccl.text()}; " if nccl else ""
    if suspect is not None:
        if spares_left > 0:
            return _on_a_spare(suspect, spares_left, said)
        if fewer is not None:
            return _on_fewer(suspect, fewer, said)
    if attempt < step_retries:
        return Decision("retry", f"{said}retry {attempt + 1} of {step_retries} in this allocation")
    if not requeue_left:
        return Decision(
            "end",
            f"{said}{step_retries} retries in this allocation failed, and the "
            f"job is not requeued (slurm.requeue={requeue}, restart {restart} "
            f"of at most {max_restarts})",
        )
    return _requeue(failures_per_node, free_nodes, f"{said}{step_retries} retries")


def _not_to_retry(
    notes: dict[int, dict[str, Any]], failure: TaskFailure | None, requeue_left: bool
) -> Decision | None:
    """A step that ended as the run meant it to, or failed in a way a new step would repeat: the
    run's own failure, bad input (exit 2), or a stop at a checkpoint (exit 75, or 76 where the
    ranks could not requeue), whose first rank to exit made srun end the others
    (--kill-on-bad-exit), so srun's own status is not the stop's."""
    own = {rank: note for rank, note in notes.items() if not note.get("retryable", True)}
    if own:
        rank, note = min(own.items())
        return Decision(
            "end",
            f"rank {rank} failed on its own ({note['message']}): a new attempt would fail "
            "the same way",
        )
    if failure is None:
        return None
    where = f"rank {failure.rank} on {failure.node}"
    if failure.how == "Exited with exit code 2":
        return Decision(
            "end", f"{where} stopped on bad input (exit 2); its message is in the job's output"
        )
    if failure.how == f"Exited with exit code {EXIT_STOPPED}":
        return Decision(
            "end",
            f"{where} stopped the run at a checkpoint (exit {EXIT_STOPPED}); srun ended the others",
        )
    if failure.how == f"Exited with exit code {EXIT_REQUEUE_ME}":
        return Decision(
            "requeue" if requeue_left else "end",
            f"{where} stopped the run at a checkpoint to be requeued (exit {EXIT_REQUEUE_ME}); "
            "srun ended the others",
        )
    return None


def _requeue(failures_per_node: dict[str, int], free_nodes: int | None, said: str) -> Decision:
    """A requeue, away from the nodes that failed twice or more where the partition has others to
    take their place."""
    repeat = sorted(node for node, count in failures_per_node.items() if count >= 2)
    exclude = tuple(repeat) if free_nodes is not None and len(repeat) <= free_nodes else ()
    why = f"{said} in this allocation failed; requeueing"
    if repeat and not exclude:
        why += (
            f" (not excluding {', '.join(repeat)}: the partition has no other nodes to take "
            "their place)"
        )
    elif exclude:
        why += f", away from {', '.join(exclude)}, which failed twice or more"
    return Decision("requeue", why, exclude)


def _on_a_spare(suspect: Suspect, spares_left: int, said: str) -> Decision:
    return Decision(
        "retry",
        f"{said}{suspect.why}; retrying in this allocation on a spare node, without "
        f"{suspect.node} ({spares_left - 1} spare(s) left)",
        (suspect.node,),
    )


def _on_fewer(suspect: Suspect, nodes: int, said: str) -> Decision:
    return Decision(
        "retry",
        f"{said}{suspect.why}; no spare node left: retrying in this allocation on {nodes} "
        f"node(s), without {suspect.node}, with the global batch kept (slurm.min_nodes)",
        (suspect.node,),
        nodes,
    )


def fewer_nodes(
    slurm: SlurmConfig, grad_accum_steps: int, step_nodes: int, usable: int
) -> int | None:
    """The most nodes a step may run on after one of its `step_nodes` failed, `usable` being the
    allocation's nodes left without it: at least slurm.min_nodes, and a count the global batch of
    slurm.nodes divides among (config/slurm.py, micro_batches). None where there is none."""
    if not shrinks(slurm):
        return None
    for nodes in range(min(step_nodes - 1, usable), slurm.min_nodes - 1, -1):
        if slurm.nodes * grad_accum_steps % nodes == 0:
            return nodes
    return None


def recover(
    run_dir: Path,
    srun_log: Path | str,
    exit_code: int,
    attempt: int,
    restart: int,
    world_size: int,
    slurm: SlurmConfig,
    free_nodes: int | None,
    spares: int = 0,
    away: tuple[str, ...] = (),
    step_nodes: int = 0,
    grad_accum_steps: int = 1,
) -> Decision:
    """Decide, and record the failure and the decision in the run's status (the script acts on
    it). `spares`: the spare nodes the script's allocation holds (slurm.spare_nodes when it was
    rendered); `away`: the nodes earlier retries of this allocation left out; `step_nodes`: the
    nodes the failed step ran on (0: slurm.nodes).
    A run directory others can write is refused first: the job ends rather than act on it."""
    rundir.require_safe(run_dir)
    run = rundir.RunDir(run_dir)
    srun_log = _read(srun_log)
    notes = {rank: note for rank in range(world_size) if (note := read_note(run, rank)) is not None}
    tasks = task_failures(srun_log)
    failure = tasks[0] if tasks else None
    status = rundir.read_status(run_dir)
    recorded = status.get("failures")
    history = [f for f in recorded if isinstance(f, dict)] if isinstance(recorded, list) else []
    record = failures.record(run, failure, notes, exit_code, attempt, restart)
    dumped, folder = failures.keep_dumps(run, len(history) + 1)
    exits = {f.rank: f.how for f in tasks}
    nccl = aborts.diagnose(exits, exit_code, dumped, world_size, str(folder))
    if nccl is not None:
        record["nccl"] = nccl.record()
    if lost := lost_nodes(srun_log):
        record["lost"] = lost
    usable = slurm.nodes + spares - len(away) - 1  # the allocation's, less the failed node
    decision = decide(
        notes,
        failure,
        attempt,
        slurm.step_retries,
        restart,
        slurm.max_restarts,
        slurm.requeue,
        failures.per_node([*history, record]),
        free_nodes,
        nccl,
        max(spares - len(away), 0),
        suspects.suspect(tasks, lost, nccl, failures.per_node(history)),
        fewer_nodes(slurm, grad_accum_steps, step_nodes or slurm.nodes, usable),
    )
    record.update(action=decision.line(), reason=decision.reason)
    rundir.write_status(run_dir, str(status.get("status", "failed")), failures=[*history, record])
    return decision


def _read(srun_log: Path | str) -> str:
    if isinstance(srun_log, str):
        return srun_log
    try:
        return srun_log.read_text(errors="replace")
    except OSError:
        return ""
