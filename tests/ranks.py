"""Run a function, or a `qgtrain` command, as N real ranks: separate processes that form a real
gloo group through torchrun-style variables, as torchrun would set them. Processes come from a
forkserver that has imported torch, transformers, PyTorch Geometric (jobs/examples) and qgtrain
once, so each rank starts in milliseconds instead of the seconds of CPU an interpreter spends
importing them, and never inherits a parent's OpenMP threads. helpers.cli runs single commands the
same way."""

from __future__ import annotations

import contextlib
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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench.common import torchrun_env

# so ranks can import tests.factories like a user's own module
ROOT = Path(__file__).resolve().parents[1]
_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "transformers",
        "transformers.models.gpt2.modeling_gpt2",
        "torch_geometric",
        "qgtrain.run",
        "qgtrain.interface.cli",
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
    _forkserver_starts()
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
    _forkserver_starts()
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


def torchrun_variables(rank: int, world_size: int, port: int) -> dict[str, str]:
    """What torchrun gives one rank of a one-node group on this machine, one thread each."""
    return {**torchrun_env(rank, world_size, port), "OMP_NUM_THREADS": "1"}


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
    os.environ.update({**torchrun_variables(rank, world_size, port), **env})
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
    env: dict[str, str] | Callable[[int], dict[str, str]] | None = None,
    log_prefix: str = "rank",
    wrap: dict[int, list[str]] | None = None,
) -> list[Any]:
    """`qgtrain <args>` as world_size real processes with torchrun-style variables, each writing to
    <cwd>/<log_prefix>-<rank>.out. Each rank leads its own process group, so a SIGKILL to the group
    takes its DataLoader workers too. The processes are forked from the forkserver that has imported
    torch, transformers and qgtrain once (ForkedCommand), which spares each the seconds of CPU a
    fresh interpreter spends importing them; `wrap` (a command put in front of some ranks', e.g.
    unshare to give one a filesystem of its own) or a PYTHONPATH of its own (another version's
    qgtrain) needs a fresh interpreter, and gets `python -m qgtrain` for every rank. `env`, as
    run_ranks takes it: the same for every rank, or a function of the rank (ranks laid out on
    nodes: LOCAL_RANK, GROUP_RANK)."""
    port = free_port()
    of_rank = env if callable(env) else (lambda rank: env or {})
    fresh = bool(wrap) or needs_fresh_interpreter(
        {**os.environ, "PYTHONPATH": str(ROOT), **of_rank(0)}
    )
    procs: list[Any] = []
    for rank in range(world_size):
        rank_env = {
            **os.environ,
            **torchrun_variables(rank, world_size, port),
            "PYTHONPATH": str(ROOT),
            **of_rank(rank),
        }
        log = cwd / f"{log_prefix}-{rank}.out"
        if not fresh:
            procs.append(ForkedCommand(args, cwd, rank_env, log))
            continue
        output = open(log, "ab")
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


# Prefixes of variables read while Python, torch or transformers start: a process forked from the
# preloaded forkserver sees those the forkserver started with
READ_AT_IMPORT = (
    "PYTHON",
    "HF_",
    "TRANSFORMERS",
    "TORCH",
    "PYTORCH",
    "ATEN_",
    "OMP_",
    "MKL_",
    "CUDA",
)
_forkserver_env: dict[str, str] | None = None


def _read_at_import(env: Mapping[str, str]) -> dict[str, str]:
    # a rank sets its own threads; PYTHONPATH is judged on its own; inductor reads its cache folder
    # when it compiles (torch/_inductor/runtime/cache_dir_utils.py), and sets it in the process
    # that first compiles, such as a test's own
    skip = ("OMP_NUM_THREADS", "PYTHONPATH", "TORCHINDUCTOR_CACHE_DIR")
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT) and k not in skip}


def _forkserver_starts() -> None:
    """Called before every use of the forkserver: the first starts it with this environment."""
    global _forkserver_env
    if _forkserver_env is None:
        _forkserver_env = _read_at_import(os.environ)


def needs_fresh_interpreter(env: Mapping[str, str]) -> bool:
    """Whether a command's whole environment differs from the forkserver's in what its imports
    read: another PYTHONPATH than this repository (another version's qgtrain), or a variable of
    READ_AT_IMPORT."""
    _forkserver_starts()
    return env.get("PYTHONPATH", str(ROOT)) != str(ROOT) or _read_at_import(env) != _forkserver_env


class ForkedCommand:
    """`python -m qgtrain ARGS` in `cwd` with `env`, its output appended to `log`, forked
    from the preloaded forkserver, with the face of subprocess.Popen the tests use (pid, poll,
    wait, returncode): what runs is the CLI's main() as the interpreter would run it, including
    its atexit work. stderr goes to `errors` where given. Returns once the process leads its own
    process group, so that a killpg right after start reaches it."""

    def __init__(
        self, args: list[str], cwd: Path, env: dict[str, str], log: Path, errors: Path | None = None
    ) -> None:
        _forkserver_starts()
        ready = _CTX.Event()
        self.proc = _CTX.Process(
            target=_command_main, args=(args, str(cwd), env, str(log), str(errors or log), ready)
        )
        self.proc.start()
        if not ready.wait(60):
            self.proc.kill()
            raise AssertionError(f"qgtrain {' '.join(args)} did not start within 60 s")
        self.pid = self.proc.pid
        self.args = ["qgtrain", *args]
        self.log = errors or log

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def poll(self) -> int | None:
        return self.proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.join(timeout)
        if self.proc.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.proc.exitcode


def _command_main(
    args: list[str], cwd: str, env: dict[str, str], log: str, errors: str, ready: Any
) -> None:
    import atexit

    os.setpgrp()
    ready.set()
    # A forkserver's child inherits "forkserver" as its start method; a fresh interpreter has the
    # platform's default, which the command's DataLoader workers must be started with.
    multiprocessing.set_start_method(None, force=True)
    for path, target in ((log, 1), (errors, 2)):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, target)
        os.close(fd)
    faulthandler.register(signal.SIGQUIT, all_threads=True)  # wait_ranks' stacks of a hung rank
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path.insert(0, cwd)  # as `python -m` puts the working directory first
    sys.argv = [os.path.join(str(ROOT), "qgtrain", "__main__.py"), *args]
    from qgtrain.interface.cli import main

    try:
        code = main(list(args))
    finally:
        atexit._run_exitfuncs()  # multiprocessing ends a child with os._exit, which skips them
        sys.stdout.flush()
        sys.stderr.flush()
    sys.exit(code)


def kill_ranks(procs: list[Any]) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for proc in procs:
        proc.wait(timeout=30)


def wait_ranks(procs: list[Any], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [proc.wait(timeout=max(deadline - time.monotonic(), 0.1)) for proc in procs]
    except subprocess.TimeoutExpired:
        stacks = _stacks_of(procs)
        kill_ranks(procs)
        raise AssertionError(f"ranks did not exit within {timeout}s\n{stacks}") from None


def _stacks_of(procs: list[Any]) -> str:
    """Where each forked rank still running is stuck: its threads' stacks (SIGQUIT, to which
    _command_main registered faulthandler), read back from the end of its output."""
    running = [p for p in procs if isinstance(p, ForkedCommand) and p.poll() is None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):  # it may end meanwhile
            os.kill(proc.pid, signal.SIGQUIT)
    if running:
        time.sleep(2)  # for faulthandler to write every thread's stack
    return "\n".join(
        f"{proc.args} (pid {proc.pid}):\n{Path(proc.log).read_text()[-4000:]}" for proc in running
    )
