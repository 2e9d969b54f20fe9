"""Subprocesses with bounded waits: a run that hangs is killed with everything it started and
becomes a FAIL line carrying its log's tail, never an uncaught TimeoutExpired that ends the whole
check."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DETERMINISTIC_ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8"
}  # cuBLAS's reproducible workspace (torch docs)


@dataclass(frozen=True)
class Finished:
    """How a bounded run ended: its exit code, or None when it was killed at its time limit."""

    code: int | None
    seconds: float
    log: Path
    why: str = ""  # what went wrong where the exit code does not say it

    @property
    def ok(self) -> bool:
        return self.code == 0 and not self.why

    def describe(self) -> str:
        what = self.why or (
            f"exit {self.code}"
            if self.code is not None
            else f"timed out after {self.seconds:.0f} s, killed"
        )
        return f"{what}; log {self.log}: ...{tail(self.log)}"


def tail(log: Path, chars: int = 600) -> str:
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return " / ".join(line for line in text[-chars:].splitlines() if line.strip())


def torchrun(world: int, module: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        "-m",
        module,
        *args,
    ]


def start(
    cmd: list[str], log: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """In a session of its own, so that killing it kills torchrun's ranks too."""
    with log.open("ab") as out:
        return subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": search_path(), **(env or {})},
        )


def search_path() -> str:
    """This tree first, then the caller's PYTHONPATH: a machine may hold a dependency there (a
    GPU image's packages beside wheels unpacked into a folder of their own)."""
    return os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))


def kill(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass  # unkillable (D state): reported as timed out all the same


def wait(
    proc: subprocess.Popen[bytes],
    log: Path,
    timeout: float,
    until: Callable[[], bool] = lambda: False,
) -> Finished:
    """Wait for `proc` to exit, at most `timeout` seconds; or, when `until` turns true first, kill
    it there (code -9: the kill was ours). A run past its limit is killed and reported with code
    None."""
    began = time.monotonic()
    while proc.poll() is None:
        if until():
            kill(proc)
            return Finished(-signal.SIGKILL, time.monotonic() - began, log)
        if time.monotonic() - began > timeout:
            kill(proc)
            return Finished(None, time.monotonic() - began, log)
        time.sleep(0.02)
    return Finished(proc.returncode, time.monotonic() - began, log)


def run(
    cmd: list[str], log: Path, timeout: float, env: Mapping[str, str] | None = None
) -> Finished:
    try:
        proc = start(cmd, log, env)
    except OSError as exc:
        log.write_text(f"could not start {cmd[:4]}: {exc}\n")
        return Finished(127, 0.0, log)
    return wait(proc, log, timeout)
