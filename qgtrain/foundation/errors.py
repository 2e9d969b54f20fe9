"""The user-facing error type and the exit codes: the contract between qgtrain and the shell that
runs it.

Anything a user can fix (a config key, a path, the environment a job was started in) is raised as a
`QgtrainError`; the CLI prints its message on one line and exits with its `exit_code`, without a
traceback. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
# The user's own code (task function, model, loss, metrics, collate, optimizer) broke the Task
# contract: code to fix, not a config value to change; never retried.
EXIT_TASK = 3
# Stopped at an agreed checkpoint after a signal. Under Slurm the job was requeued (unless
# slurm.requeue is off or slurm.max_restarts is reached); elsewhere, running the same command again
# resumes. 75 is EX_TEMPFAIL from sysexits.h: "try again later".
EXIT_STOPPED = 75
# Stopped at an agreed checkpoint, but this process could not requeue the job (no `scontrol`, e.g.
# inside a container): train.slurm turns this code into `scontrol requeue` from the batch shell.
EXIT_REQUEUE_ME = 76


class QgtrainError(Exception):
    """A problem the user can act on. The message names what was wrong, what is allowed, and the
    fix.

    `retryable`: the failure is the machine's, not the run's (a peer that vanished, a write that
    failed on a flaky filesystem), so a new attempt may succeed; the run's own failures (a config, a
    bad value, a task that raises) are never retried, since they would fail the same way again."""

    exit_code = EXIT_USAGE
    retryable = False


class ConfigError(QgtrainError):
    """A config file, overlay or `--set` value that does not fit the schema."""


class TaskError(QgtrainError):
    """The user's own code returned or built something qgtrain cannot train with (a loss that is not
    a scalar, metrics of another shape, a task function that returns no Task). The message names the
    function and what it must return."""

    exit_code = EXIT_TASK


class RendezvousError(QgtrainError):
    """An environment that does not describe a consistent set of ranks."""


class CheckpointError(QgtrainError):
    """A checkpoint that is missing, unreadable or does not fit the run."""


class TrainingError(QgtrainError):
    """Training was stopped on every rank for a diagnosed reason (non-finite loss, a hang, ...)."""

    exit_code = EXIT_FAILED


class PeerFailure(TrainingError):
    """This rank stopped because a collective could not complete: another rank died, hung or
    failed."""

    retryable = True


class CheckpointWriteError(TrainingError):
    """A checkpoint could not be written (a full disk, a filesystem that failed); the previous one
    is intact."""

    retryable = True


class JoinError(RendezvousError):
    """The ranks did not all reach the rendezvous in time: a node that never started, a network
    between them."""

    retryable = True


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The gist of an exception for a one-line message: its first line, or its type when it says
    nothing."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:limit]


def summary(exc: BaseException, limit: int = 500) -> str:
    """One line on why something stopped: a QgtrainError's own message, else the type and its first
    line (a bug's type is half of what it says)."""
    if isinstance(exc, QgtrainError):
        return first_line(exc, limit)
    return f"{type(exc).__name__}: {first_line(exc, limit)}"[:limit]
