"""Run a function as N real ranks: separate processes that form a real gloo group through
torchrun-style variables, as torchrun would set them. Processes come from a forkserver that has
imported torch and transformers once, so each rank starts in milliseconds and never inherits a
parent's OpenMP threads."""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

# so ranks can import tests.factories like a user's own module
ROOT = Path(__file__).resolve().parents[1]
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "transformers",
        "transformers.models.gpt2.modeling_gpt2",
        "qgtrain.run",
        "tests.ranks",
    ]
)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ranks(
    world_size: int,
    target: Callable[..., Any],
    *args: Any,
    env: dict[str, str] | Callable[[int], dict[str, str]] | None = None,
    timeout: float = 180.0,
) -> list[Any]:
    """target(*args) on every rank; returns each rank's result, or raises if a rank failed or hung.
    `env`: variables for every rank, or a function of the rank giving each its own."""
    port = free_port()
    results: Any = _CTX.Queue()
    stacks = tempfile.mkdtemp(prefix="qgtrain-ranks-")
    envs = [env(rank) if callable(env) else env or {} for rank in range(world_size)]
    procs = [
        _CTX.Process(
            target=_rank_main,
            args=(rank, world_size, port, envs[rank], target, args, results, stacks, timeout - 5),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            try:
                rank, ok, value = pickle.loads(results.get(timeout=1.0))
            except queue.Empty:
                dead = [
                    r for r, p in enumerate(procs) if p.exitcode is not None and r not in collected
                ]
                if dead and results.empty():
                    raise AssertionError(
                        f"rank(s) {dead} exited ({[procs[r].exitcode for r in dead]}) "
                        "without a result"
                    ) from None
                if time.monotonic() > deadline:
                    missing = sorted(set(range(world_size)) - set(collected))
                    dumps = "".join(
                        f"\n--- rank {r} stacks ---\n"
                        + _read(os.path.join(stacks, f"rank-{r}.txt"))
                        for r in missing
                    )
                    raise AssertionError(
                        f"ranks {missing} did not finish within {timeout}s{dumps}"
                    ) from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            collected[rank] = value
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return [collected[rank] for rank in range(world_size)]


def start_ranks(world_size: int, target: Callable[..., Any], *args: Any) -> list[Any]:
    """target(*args) on every rank as run_ranks starts them, not waited for: for a test that
    SIGKILLs ranks at work (Process.kill) without the seconds each `qgtrain` process spends
    importing."""
    port, results, stacks = free_port(), _CTX.Queue(), tempfile.mkdtemp(prefix="qgtrain-ranks-")
    procs = [
        _CTX.Process(
            target=_rank_main,
            args=(rank, world_size, port, {}, target, args, results, stacks, 600.0),
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.results = results  # the queue lives as long as its ranks: they open it as they start
        proc.start()
    return procs


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return "(no stack dump: the process never started or was killed)"


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    env: dict[str, str],
    target: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
    stacks: str,
    dump_after: float,
) -> None:
    dump = open(os.path.join(stacks, f"rank-{rank}.txt"), "w")
    faulthandler.dump_traceback_later(max(dump_after, 1.0), file=dump)  # where a hung rank is stuck
    os.environ.update(
        {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            **env,
        }
    )
    # Plain pickled bytes: torch's queue reductions would share tensors through file descriptors
    # that vanish with this process.
    try:
        results.put(pickle.dumps((rank, True, target(*args))))
    except BaseException:  # report everything, including SystemExit, to the test
        results.put(pickle.dumps((rank, False, traceback.format_exc())))


def train_rank(cfg: Any, run_dir: str) -> dict[str, Any]:
    """One rank of `qgtrain train`, reporting what the CLI would: the exit code, or the error and
    its code."""
    from qgtrain.foundation.errors import QgtrainError
    from qgtrain.run import train
    from qgtrain.runtime.rendezvous import from_environ

    try:
        return {"exit": train(cfg, from_environ(os.environ), run_dir), "error": None}
    except QgtrainError as exc:
        return {"exit": exc.exit_code, "error": str(exc)}


def start_cli_ranks(
    world_size: int,
    args: list[str],
    cwd: Path,
    env: dict[str, str] | None = None,
    log_prefix: str = "rank",
    wrap: dict[int, list[str]] | None = None,
) -> list[subprocess.Popen[bytes]]:
    """`python -m qgtrain <args>` as world_size real processes with torchrun-style variables. Each
    rank leads its own process group, so a SIGKILL to the group takes its DataLoader workers too.
    `wrap` puts a command in front of some ranks' (e.g. unshare, to give one rank a filesystem of
    its own)."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            **(env or {}),
        }
        output = open(cwd / f"{log_prefix}-{rank}.out", "ab")
        procs.append(
            subprocess.Popen(
                [*(wrap or {}).get(rank, []), sys.executable, "-m", "qgtrain", *args],
                cwd=cwd,
                env=rank_env,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    return procs


def kill_ranks(procs: list[subprocess.Popen[bytes]]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait(timeout=30)


def wait_ranks(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [proc.wait(timeout=max(deadline - time.monotonic(), 0.1)) for proc in procs]
    except subprocess.TimeoutExpired:
        kill_ranks(procs)
        raise AssertionError(f"ranks did not exit within {timeout}s") from None
