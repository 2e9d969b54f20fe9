"""Logging: rank 0 to the console, every rank to its own file, each line prefixed with its rank."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from pathlib import Path

from ..foundation.files import open_append
from .rendezvous import DistEnv

LOGGER = "qgtrain"


def setup_console(env: DistEnv, level: str) -> logging.Logger:
    """Rank 0 logs at `level`; other ranks only warnings, so N ranks do not print N copies of
    everything."""
    close()
    logger = logging.getLogger(LOGGER)
    logger.setLevel(level)
    logger.propagate = False
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(level if env.is_main else logging.WARNING)
    console.setFormatter(_formatter(env))
    logger.addHandler(console)
    _quiet_libraries()
    return logger


class _RankFile(logging.FileHandler):
    """A FileHandler (diagnose.py writes stacks into its stream) whose file is opened by
    files.open_append: never through a link planted at the log's predictable name."""

    def _open(self) -> io.TextIOWrapper:
        return open_append(Path(self.baseFilename))


def add_rank_file(env: DistEnv, path: Path, level: str) -> None:
    """Append this rank's log to its file in the run directory (appended across restarts)."""
    path.parent.mkdir(mode=0o750, parents=True, exist_ok=True)  # within the run's own mode
    handler = _RankFile(path, mode="a")
    handler.setLevel(level)
    handler.setFormatter(_formatter(env))
    logging.getLogger(LOGGER).addHandler(handler)


def traceback_to_file(exc: BaseException) -> None:
    """The whole traceback of why this rank stopped, to its file only: the console and the CLI tell
    it in one line, which names the file."""
    logger = logging.getLogger(LOGGER)
    why = (type(exc), exc, exc.__traceback__)
    record = logger.makeRecord(LOGGER, logging.ERROR, "", 0, "why this rank stopped:", (), why)
    for handler in logger.handlers:
        if isinstance(handler, _RankFile):
            handler.handle(record)


def where_this_rank_runs(env: DistEnv) -> str:
    """Each rank's first line in its own log: where it runs and how it found the others."""
    job = f", Slurm job {env.requeue_id} restart {env.restart_count}" if env.in_slurm_job else ""
    return (
        f"rank {env.rank} on node {env.node_name} (local rank {env.local_rank}), rendezvous "
        f"{env.master_addr}:{env.master_port} (port {env.port_source}){job}"
    )


def close() -> None:
    """Every handler removed and closed; a rank log that cannot be flushed (a full disk) is let
    go, so that the failure that stopped the run is the one told."""
    logger = logging.getLogger(LOGGER)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        with contextlib.suppress(OSError):
            handler.close()


def _formatter(env: DistEnv) -> logging.Formatter:
    return logging.Formatter(
        f"%(asctime)s [rank {env.rank}] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S"
    )


def _quiet_libraries() -> None:
    """transformers and torch announce things users cannot act on here (their info and warnings
    about process groups and DDP internals): only their errors are shown."""
    for name in ("transformers", "torch.distributed", "torch.nn.parallel"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*TypedStorage is deprecated.*")
