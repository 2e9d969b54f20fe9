"""The rendezvous store is reachable from the network and takes keys from anyone: what ranks read
from it never runs as code, and rank 0's store listens on MASTER_ADDR's address only. Real 2-rank
gloo groups (tests/ranks.py), a real hostile client on the store's port, real sockets."""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import threading
import time
from pathlib import Path

import pytest
import torch

from qgtrain.foundation.errors import CheckpointError, ConfigError, QgtrainError, TrainingError
from qgtrain.runtime import comms, store, wire
from tests.helpers import works_once
from tests.ranks import free_port, run_ranks

ONCE = "default_pg/0//qgtrain/once/0"  # the first qgtrain/once key, as torch's prefixes make it


class Planted:
    """Unpickling this makes the folder `marker`: code run by whoever reads the key."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, ...]:
        return os.mkdir, (self.marker,)


def hostile_client(
    port: int, values: dict[str, str], adds: list[str], done: threading.Event
) -> None:
    """Any process on the network: connect to the job's store port and write keys, as soon as it
    opens."""
    import torch.distributed as dist

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.01)
    client = dist.TCPStore(
        "127.0.0.1", port, None, False, datetime.timedelta(seconds=30), wait_for_workers=False
    )
    for key in adds:
        client.add(key, 1)
    for key, value in values.items():
        client.set(key, value)
    done.set()


@pytest.mark.parametrize("hidden", [False, True], ids=["rank-0-result", "per-node-result"])
def test_a_pickle_planted_in_the_store_never_runs_on_any_rank(tmp_path, hidden):
    """Fails on 26ab7a7: rank 1 unpickled the planted value, and the marker folder appeared."""
    marker = tmp_path / "planted-code-ran"
    payload = pickle.dumps(("ok", Planted(str(marker)))).hex()
    port, done = free_port(), threading.Event()
    host_key = f"{ONCE}/{socket.gethostname()}"
    values = {host_key: payload} if hidden else {ONCE: payload}
    attacker = threading.Thread(
        target=hostile_client, args=(port, values, [f"{host_key}/asked"] if hidden else [], done)
    )
    attacker.start()
    results = run_ranks(
        2, works_once, str(tmp_path), hidden, 8.0, 3.0, env={"MASTER_PORT": str(port)}
    )
    attacker.join(timeout=30)
    assert done.is_set(), "the hostile client never wrote its keys"
    assert not marker.exists(), "a value from the store ran as code"
    assert results[1].startswith(
        f"QgtrainError: the rendezvous store's key qgtrain/once/0"
        f"{'/' + socket.gethostname() if hidden else ''} holds '8"
    ), results[1]
    assert "which is not a value a qgtrain rank writes. HINT: another process" in results[1]


def fails_on_rank_0(kind: str) -> list[str]:
    """Rank 0's work (main_works_long) and decision (main_decides) raise; every rank reports
    both."""
    from qgtrain.runtime import distributed
    from qgtrain.runtime.rendezvous import from_environ

    class TasksOwn(ConfigError):
        """A task's own error type, which no other rank can import by name."""

    raised = {
        "checkpoint": CheckpointError("step-4 is damaged"),
        "training": TrainingError("loss is nan"),
        "own": TasksOwn("data.files: none match"),
    }[kind]

    def fail() -> str:
        raise raised

    seen = []
    with distributed.process_group(from_environ(os.environ), torch.device("cpu"), 60, 60):
        for call in (
            lambda: distributed.main_works_long(fail, "fails", ("its limit", 30.0)),
            lambda: distributed.main_decides(fail),
        ):
            try:
                call()
                seen.append("no error")
            except QgtrainError as exc:
                seen.append(f"{type(exc).__name__}: {exc}")
    return seen


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("checkpoint", "CheckpointError: step-4 is damaged"),
        ("training", "TrainingError: loss is nan"),
        ("own", "ConfigError: data.files: none match"),
    ],
)
def test_an_error_of_rank_0_s_work_reaches_every_rank_as_its_qgtrain_type(kind, expected):
    """qgtrain's own types passed on 26ab7a7 too (the class crossed pickled) and guard that they
    still arrive by name. A task's own type failed there: a class pickle cannot import by name (here
    a local one) crashed rank 0; it now arrives as the qgtrain type it extends."""
    assert run_ranks(2, fails_on_rank_0, kind) == [[expected, expected]] * 2


def connects(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
        return True
    except OSError:
        return False


def who_reaches_the_store() -> dict[str, bool] | None:
    """On rank 0, inside the group: which local addresses reach the store's port."""
    from qgtrain.runtime import distributed
    from qgtrain.runtime.rendezvous import from_environ

    env = from_environ(os.environ)
    with distributed.process_group(env, torch.device("cpu"), 60, 60):
        others = [
            i.address
            for i in comms.machine_interfaces()
            if i.address and not i.address.startswith("127.")
        ]
        reached = (
            {a: connects(a, env.master_port) for a in ["127.0.0.1", "127.0.0.2", *others]}
            if env.is_main
            else None
        )
        distributed.barrier()
        return reached


def test_the_store_listens_on_master_addr_only():
    """Fails on 26ab7a7: the store listened on `::`, and 127.0.0.2 (and the host's own address)
    reached it."""
    reached = run_ranks(2, who_reaches_the_store)[0]
    assert reached == {address: address == "127.0.0.1" for address in reached}, reached


def test_a_store_that_cannot_be_bound_to_master_addr_listens_everywhere_and_the_job_starts():
    """Two nodes with MASTER_ADDR on loopback (other nodes could not reach it): rank 0 falls back to
    torch's own listener on every interface, and the ranks still join."""
    reached = run_ranks(2, who_reaches_the_store, env={"LOCAL_WORLD_SIZE": "1", "LOCAL_RANK": "0"})[
        0
    ]
    assert reached["127.0.0.2"] and reached["127.0.0.1"]


def test_the_listener_refuses_what_it_cannot_bind_and_says_why():
    port = free_port()
    listener, why = store.bound_listener("127.0.0.1", port, 1)
    assert listener is not None and why == (
        f"listens on 127.0.0.1 port {port} only (MASTER_ADDR 127.0.0.1)"
    )
    try:
        assert connects("127.0.0.1", port) and not connects("127.0.0.2", port)
        again, why = store.bound_listener("127.0.0.1", port, 1)
        assert again is None and why.endswith("cannot be bound: Address already in use")
    finally:
        listener.close()
    behind_nat, why = store.bound_listener("192.0.2.77", port, 2)  # TEST-NET-1: no host has it
    assert behind_nat is None and why.endswith("cannot be bound: Cannot assign requested address")
    loopback, why = store.bound_listener("127.0.0.1", port, 2)
    assert loopback is None and "which other nodes cannot reach" in why
    nowhere, why = store.bound_listener("no-such-host.invalid", port, 2)
    assert nowhere is None and why.startswith(
        "MASTER_ADDR no-such-host.invalid does not resolve here"
    )


@pytest.mark.parametrize(
    "text, says",
    [
        (
            "80049520000000000000008c02",
            "holds '80049520000000000000008c02'..., which is not a value",
        ),
        ('{"error": "SystemExit", "message": "bye"}', "an error of an unknown type 'SystemExit'"),
        (
            '{"error": "os.system", "message": "touch /tmp/x"}',
            "an error of an unknown type 'os.system'",
        ),
        ('{"ok": 1, "extra": 2}', "which is not a value a qgtrain rank writes"),
        ("[1, 2]", "which is not a value a qgtrain rank writes"),
        (b"\xff\xfe", "which is not a value a qgtrain rank writes"),
    ],
)
def test_what_qgtrain_does_not_write_is_refused_as_a_qgtrain_error(text, says):
    with pytest.raises(QgtrainError, match="HINT: another process on the network") as caught:
        wire.decode(text, "the key k")
    assert type(caught.value) is QgtrainError and says in str(caught.value)


def test_a_result_crosses_as_json_and_an_error_by_its_qgtrain_name():
    crossed = wire.decode(wire.result((3, "exported", Path("x").as_posix())), "k")
    assert crossed == [3, "exported", "x"]
    with pytest.raises(TypeError, match="must be a JSON value"):
        wire.result(Path("x"))
    with pytest.raises(CheckpointError, match="^bad$"):
        wire.decode(wire.error(CheckpointError("bad")), "k")
