"""Turning the ways a training step dies into one clear error: the cause, the step, the ranks, the
fix.

The errors are not caught to carry on: each becomes a TrainingError that stops this rank, and the
other ranks learn of it when their next collective fails, which is explained here too. A rank whose
collective fails writes every thread's stack to its log and names the ranks that did not arrive; a
watchdog bounds the time any teardown may take, so a job never hangs until its time limit.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import logging
import os
import re
import shutil
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from ..foundation.errors import PeerFailure, TrainingError
from . import comms
from .rendezvous import DistEnv

log = logging.getLogger("qgtrain")
_COLLECTIVE_SIGNS = (
    "connection closed",
    "connection reset",
    "timed out",
    "timeout",
    "broken pipe",
    "socket",
    "gloo",
    "nccl",
    "remote worker",
    "peer",
)


def arm_watchdog(seconds: float) -> None:
    """If this process is still alive `seconds` from now, dump every thread's stack to stderr and
    exit.

    faulthandler's timer thread needs no GIL, so it fires even when the main thread is stuck in C
    code.
    """
    faulthandler.dump_traceback_later(seconds, exit=True)


class ProgressWatchdog:
    """Exits with every thread's stack when no step completes for `seconds`: it catches the hangs
    that no collective timeout sees (a stuck data loader, a deadlocked thread).

    Re-arming faulthandler's timer joins its thread and starts another, which takes milliseconds
    when every core is training (bench.train_speed's tiny preset shows it), paid on every rank and
    waited for by all at the next gradient all-reduce. So the timer is re-armed only once `slack`
    has passed since it was last armed, for `seconds + slack`: a stuck rank exits between `seconds`
    and `seconds + slack` after its last progress.
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.slack = min(60.0, seconds / 10)
        self._armed_at = -float("inf")

    def progress(self) -> None:
        now = time.monotonic()
        if now - self._armed_at >= self.slack:
            arm_watchdog(self.seconds + self.slack)
            self._armed_at = now


def disarm_watchdog() -> None:
    faulthandler.cancel_dump_traceback_later()


def explain(
    exc: BaseException, step: int, env: DistEnv, num_workers: int, timeout_s: float
) -> BaseException:
    """A TrainingError for a failure we recognise (raise it from `exc`), or `exc` itself."""
    text = str(exc)
    if isinstance(exc, torch.OutOfMemoryError):
        return TrainingError(
            f"rank {env.rank} ran out of GPU memory in step {step}. HINT: lower train.batch_size "
            "and raise train.grad_accum_steps to keep the same effective batch, use "
            "train.precision: bf16, or a smaller data.seq_len; emptying the CUDA cache does not "
            "help"
        )
    if "DataLoader worker" in text or (isinstance(exc, ConnectionError) and num_workers > 0):
        return TrainingError(
            f"a DataLoader worker of rank {env.rank} died in step {step} ({_gist(text)}). Likely "
            f"cause: shared memory (/dev/shm has {_shm_gb():.1f} GB for "
            f"data.num_workers={num_workers} worker(s) x {env.local_world_size} rank(s) on this "
            "node) or the worker ran out of memory. HINT: set data.num_workers to 0 or fewer "
            "workers, or request more shared memory (a container's --shm-size)"
        )
    if "Expected to have finished reduction in the prior iteration" in text:
        return TrainingError(
            f"DDP found parameters that received no gradient in step {step - 1} on some rank(s): "
            "they were unused on that step only. HINT: set train.find_unused_parameters: true "
            "(slower), or make every step use every parameter"
        )
    if is_broken_collective(exc):
        return peer_failure(exc, f"in step {step}", env, timeout_s)
    return exc


@contextlib.contextmanager
def peers_watched(env: DistEnv, timeout_s: float) -> Iterator[None]:
    """Around everything a rank does outside the step loop (building the task, restoring, the last
    wait): a peer that dies there breaks a collective as surely as in a step, and is the machine's
    failure, which the batch script retries, not the run's own, which it would not."""
    try:
        yield
    except (dist.DistError, RuntimeError) as exc:
        if not is_broken_collective(exc):
            raise
        raise peer_failure(exc, "outside the step loop", env, timeout_s) from exc


def is_broken_collective(exc: BaseException) -> bool:
    return isinstance(exc, (dist.DistError, RuntimeError)) and any(
        sign in str(exc).lower() for sign in _COLLECTIVE_SIGNS
    )


def peer_failure(exc: BaseException, where: str, env: DistEnv, timeout_s: float) -> PeerFailure:
    _dump_stacks(exc)
    missing = missing_ranks(env)
    who = f"rank(s) {missing} did not arrive" if missing else "a peer rank failed"
    arm_watchdog(30.0)  # the teardown that follows may not hang on the broken group
    return PeerFailure(
        f"a collective failed {where} on rank {env.rank}: {who} ({_gist(str(exc))}). Every "
        "surviving rank's stack is in its log. HINT: read the log of the rank(s) named "
        "(logs/rank_<N>.log) and the job's output for why they died or stalled; if steps or "
        f"checkpoint writes legitimately take longer than {timeout_s:.0f}s, raise "
        f"train.collective_timeout_s{_nccl_evidence()}"
    )


def _nccl_evidence() -> str:
    dumps = comms.nccl_dumps()
    if dumps is None:
        return ""
    folder = os.path.dirname(dumps)
    return (
        ". On NCCL a timed-out collective also dumps every rank's last collectives to "
        f"{dumps}<rank>: `torchfrtrace {folder}` says which rank stopped where"
    )


def non_finite_loss(step: int, agree_every: int, ranks: list[int]) -> TrainingError:
    checked = "" if agree_every == 1 else f" (or up to {agree_every - 1} before)"
    where = (
        f"the loss became non-finite at step {step}{checked} on rank(s) {ranks}"
        if ranks
        else f"the gradients became non-finite at step {step}{checked} "
        "(the loss was finite on every rank)"
    )
    return TrainingError(
        f"{where}; the step was not applied and no checkpoint was written. HINT: lower optim.lr or "
        "raise optim.warmup_steps, keep optim.grad_clip on, prefer bf16 to fp16, and check the "
        "data; then resume from the last checkpoint"
    )


def too_many_spikes(
    step: int, loss: float, median: float, spikes: int, max_skips: int
) -> TrainingError:
    return TrainingError(
        f"the loss spiked at step {step} ({loss:.6g} against a recent median of {median:.6g}): "
        f"spike {spikes} of the run, more than train.max_skips={max_skips}. Spikes this often are "
        "not one bad batch: the data or the learning rate is the problem. The step was not "
        "applied. HINT: lower optim.lr or raise optim.warmup_steps, and look at the data of the "
        'steps that metrics.jsonl records as "skipped"; raise train.spike_factor if such losses '
        "are normal for this run; then resume from the last checkpoint"
    )


def unused_parameters(step: int, ranks: list[int], names: list[str]) -> TrainingError:
    return TrainingError(
        f"{len(names)} parameter(s) received no gradient in step {step} on rank(s) {ranks}: "
        f"{_some(names, 10)}. DDP cannot reduce gradients that never arrive. HINT: remove the "
        "unused parameters or freeze them (requires_grad_(False)); if they are unused only on some "
        "steps, set train.find_unused_parameters: true (slower)"
    )


def diverged_replicas(step: int, names: list[str]) -> TrainingError:
    return TrainingError(
        f"the ranks' copies of the model differ at step {step}: {_some(names, 5)}; no checkpoint "
        "was written. HINT: something changed them on some ranks only: an in-place update of a "
        "frozen parameter, a buffer that DDP does not copy from rank 0 (one named in "
        "_ddp_params_and_buffers_to_ignore), or weights set after the task was built"
    )


def _some(names: list[str], most: int) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def missing_ranks(env: DistEnv, wait_s: float = 3.0) -> list[int] | None:
    """The ranks that do not answer: each surviving rank posts to the rendezvous store, waits a
    moment, and lists who posted. If the store (hosted by rank 0) is gone or cannot be reached, rank
    0 is what is missing. The store's client can block for minutes on a cut network, so the probe
    runs in a thread and is given up on after a few seconds."""
    if env.world_size == 1:
        return []
    answer: list[list[int] | None] = []
    probe = threading.Thread(target=lambda: answer.append(_unanswered(env, wait_s)), daemon=True)
    probe.start()
    probe.join(wait_s + 5.0)
    if answer and answer[0] is not None:
        return answer[0]
    return [0] if env.rank != 0 else None


def _unanswered(env: DistEnv, wait_s: float) -> list[int] | None:
    try:
        store = dist.distributed_c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=5))
        store.set(f"qgtrain/alive/{env.rank}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            alive = [r for r in range(env.world_size) if store.check([f"qgtrain/alive/{r}"])]
            if len(alive) == env.world_size or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        return [r for r in range(env.world_size) if r not in alive]
    # the store's host, rank 0, is gone
    except (RuntimeError, dist.DistError, TimeoutError, OSError):
        return None


def _dump_stacks(exc: BaseException) -> None:
    """Where the failed collective was called, then every thread's stack, into this rank's log file
    (the console keeps the one-line error)."""
    where = "".join(traceback.format_exception(exc)).rstrip()
    for handler in logging.getLogger("qgtrain").handlers:
        stream: Any = getattr(handler, "stream", None)
        if isinstance(handler, logging.FileHandler) and stream is not None:
            try:
                stream.write(
                    f"--- rank stacks at {time.strftime('%Y-%m-%d %H:%M:%S')} ---\n"
                    f"the failed collective:\n{where}\nall threads:\n"
                )
                stream.flush()
                faulthandler.dump_traceback(file=stream, all_threads=True)
            except (OSError, ValueError):
                pass


def _shm_gb() -> float:
    try:
        return shutil.disk_usage("/dev/shm").total / 1e9
    except OSError:
        return 0.0


def _gist(text: str) -> str:
    """The gist of a library's message: first line, without gloo's source location and advice."""
    line = (text.strip().splitlines() or [""])[0]
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", line)
    return line.split(" This is typically")[0][:300]
