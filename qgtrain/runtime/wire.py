"""What one rank tells the others through the rendezvous store: a result or a qgtrain error (JSON).

The store listens on the network without authentication and its keys are predictable, so whatever
is read from it is data from anyone who can reach the port: it is parsed as JSON, never unpickled,
and an error names its class, which is looked up in a fixed table of qgtrain's own error types
(never imported or built from a name on the wire). A value that is not what qgtrain writes stops
the rank with a QgtrainError: it can mislead the job (a wrong answer), never run code in it.
"""

from __future__ import annotations

import json
from typing import Any

from ..foundation.errors import (
    CheckpointError,
    CheckpointWriteError,
    ConfigError,
    JoinError,
    PeerFailure,
    QgtrainError,
    RendezvousError,
    TaskError,
    TrainingError,
)

# qgtrain's own error types by name: an error from another rank becomes one of these, nothing else.
ERRORS: dict[str, type[QgtrainError]] = {
    cls.__name__: cls
    for cls in (
        QgtrainError,
        ConfigError,
        RendezvousError,
        CheckpointError,
        TrainingError,
        PeerFailure,
        CheckpointWriteError,
        JoinError,
        TaskError,
    )
}


def error_name(exc: QgtrainError) -> str:
    """The nearest class of `exc` in the table: a subclass defined elsewhere (a task's own) crosses
    as the qgtrain type it extends, with its message."""
    return next(cls.__name__ for cls in type(exc).__mro__ if ERRORS.get(cls.__name__) is cls)


def result(value: Any) -> str:
    """A result as the text other ranks read. Only JSON values cross (a tuple arrives as a list), so
    the rank that sends decodes its own text to return what every other rank returns."""
    try:
        return json.dumps({"ok": value}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise TypeError(
            "a result sent between ranks must be a JSON value (str, number, bool, "
            f"None, lists and dicts of them): {exc}"
        ) from None


def error(exc: QgtrainError) -> str:
    return json.dumps({"error": error_name(exc), "message": str(exc)})


def decode(text: str | bytes, where: str) -> Any:
    """The result in `text`, or the error it carries raised as its qgtrain type. `where`: the key
    or collective it came from, for the message when it is not something qgtrain wrote."""
    try:
        outcome = json.loads(text)
    except (ValueError, UnicodeDecodeError):
        outcome = None
    if isinstance(outcome, dict) and set(outcome) == {"ok"}:
        return outcome["ok"]
    if (
        isinstance(outcome, dict)
        and set(outcome) == {"error", "message"}
        and isinstance(outcome["message"], str)
    ):
        found = ERRORS.get(outcome["error"]) if isinstance(outcome["error"], str) else None
        if found is not None:
            raise found(outcome["message"])
        raise QgtrainError(
            f"{where} carries an error of an unknown type "
            f"{str(outcome['error'])[:60]!r}, which no qgtrain rank sends. {_HINT}"
        )
    shown = text[:40] if isinstance(text, str) else text[:40].decode("utf-8", "replace")
    raise QgtrainError(
        f"{where} holds {shown!r}..., which is not a value a qgtrain rank writes. {_HINT}"
    )


_HINT = (
    "HINT: another process on the network wrote to this job's rendezvous port; qgtrain "
    "refused it rather than run it. Run jobs where only their own nodes reach each other, "
    "and report it"
)
