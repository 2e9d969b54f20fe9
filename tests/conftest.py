"""Shared fixtures. The Slurm test cluster (tests/cluster/start.sh) is started once per session by
the first test that needs it and stopped by PID at the end. It needs root; where root is there, a
failure to start it fails those tests rather than skipping them. In CI (CI set) a missing
prerequisite fails too: a suite that silently skipped its cluster tests must not pass there."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

# Two xdist workers share two cores, and each starts processes with OpenMP thread pools: threads
# that spin while they wait take the cores the other worker's ranks need (two 2-thread runs side by
# side took 4x as long as with passive waiting). Set before torch is first imported here, and
# inherited by every rank, CLI run and Slurm job the suite starts; results do not depend on it, only
# time does.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

CLUSTER = Path(__file__).resolve().parent / "cluster"
LAB = Path(os.environ.get("QGTRAIN_SLURM_LAB", "/tmp/qgtrain-slurm"))


# pytest-xdist's units of work: a unit runs whole on one worker. The tests that use the Slurm
# cluster, and only they, live in files named so, and are one unit: the session fixtures built on
# the cluster exist once, and its tests take turns on the nodes of its default partition, which some
# take down or throttle. The jobs of SIDE_TESTS, which mostly wait out real time limits on the
# cluster's side partition, are submitted when the cluster starts (tests/slurm_side.py), so their
# minutes pass while the unit's other tests run, and the tests read what they did. A module whose
# tests share a module-scoped fixture (a reference run trained once) is one unit, or each worker
# would build the fixture again. Every other test is a unit of its own.
CLUSTER_TESTS = "tests/test_slurm"
SIDE_TESTS = "tests/test_slurm_limits.py"
SHARED_FIXTURE_MODULES = (
    "tests/test_evals.py",
    "tests/test_export.py",
    "tests/test_fsdp.py",
    "tests/test_own_model.py",
    "tests/test_molecules.py",
    "tests/test_resume.py",
    "tests/test_trust_checkpoint.py",
    "tests/test_trust_eval.py",
    "tests/test_spikes.py",
    "tests/test_rollback.py",
    "tests/test_ema.py",
    "tests/test_ema_resume.py",
    "tests/test_adapters.py",
    "tests/test_streams.py",
    "tests/test_mix.py",
    "tests/test_stream_files.py",
    "tests/test_lm_shape.py",
    "tests/test_readme_example.py",
    "tests/test_local_tier.py",
)


def work_unit(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    if module.startswith(CLUSTER_TESTS):
        return "slurm-cluster"
    return module if module in SHARED_FIXTURE_MODULES else nodeid


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Keeps the units above true as tests are added."""
    for item in items:
        module = item.nodeid.split("::")[0]
        if "slurm_cluster" in getattr(item, "fixturenames", ()) and not module.startswith(
            CLUSTER_TESTS
        ):
            raise pytest.UsageError(
                f"{item.nodeid} uses the Slurm cluster: tests on it belong in "
                f"{CLUSTER_TESTS}*.py, which one pytest-xdist worker runs"
            )
        if work_unit(item.nodeid) == item.nodeid and _uses_a_module_fixture(item):
            raise pytest.UsageError(
                f"{item.nodeid} uses a module-scoped fixture: add {module} to "
                "SHARED_FIXTURE_MODULES in tests/conftest.py, so that one worker builds it once"
            )


def _uses_a_module_fixture(item: pytest.Item) -> bool:
    # pytest's record of the fixtures a test function uses
    info = getattr(item, "_fixtureinfo", None)
    return info is not None and any(
        definition.scope == "module"
        for definitions in info.name2fixturedefs.values()
        for definition in definitions
    )


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Under --dist loadgroup, xdist schedules the units of work_unit, largest first. (xdist's own
    xdist_group marker groups by rewriting node ids, which pytest 9 no longer lets it do.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByWorkUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return ByWorkUnit(config, log) if config.getvalue("dist") == "loadgroup" else None


CLUSTER_USERS = Path("/tmp/qgtrain-slurm.users")  # {"run": test run id, "pids": [its workers]}


@pytest.fixture(scope="session")
def slurm_cluster(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A running Slurm cluster of five nodes, node1-3 in the default partition and node4-5 in
    `side`; yields its slurm.conf. Clients find it through SLURM_CONF. The workers of one test run
    share it: the first starts it, the last to finish stops it (by PID), and another test run waits
    for them instead of sharing it. When SIDE_TESTS are to run, their jobs start at once."""
    if os.geteuid() != 0:
        _cannot_start("the Slurm test cluster needs root (it starts munged, slurmctld and slurmd)")
    if not shutil.which("slurmctld") and not shutil.which("apt-get"):
        _cannot_start("Slurm is not installed and there is no apt-get to install it")
    _join_cluster()
    saved = {key: os.environ.get(key) for key in ("SLURM_CONF", "QGTRAIN_PYTHON")}
    os.environ["SLURM_CONF"] = str(LAB / "slurm.conf")
    os.environ["QGTRAIN_PYTHON"] = sys.executable  # batch scripts train with this interpreter
    if any(item.nodeid.startswith(SIDE_TESTS) for item in request.session.items):
        from tests import slurm_side

        slurm_side.start(tmp_path_factory)
    try:
        yield LAB / "slurm.conf"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _leave_cluster()


def _join_cluster() -> None:
    # xdist's id of this test run, the same in each of its workers
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"pid-{os.getpid()}")
    while True:
        with _cluster_lock():
            users = _cluster_users()
            if users["pids"] and users["run"] != run:
                pass  # another test run's: wait for it to stop the cluster
            else:
                if not users["pids"]:
                    _start_cluster()
                users = {"run": run, "pids": [*users["pids"], os.getpid()]}
                CLUSTER_USERS.write_text(json.dumps(users))
                return
        time.sleep(2)


def _leave_cluster() -> None:
    with _cluster_lock():
        users = _cluster_users()
        others = [pid for pid in users["pids"] if pid != os.getpid()]
        CLUSTER_USERS.write_text(json.dumps({**users, "pids": others}))
        if not others:
            subprocess.run(["bash", str(CLUSTER / "stop.sh")], capture_output=True, timeout=300)


@contextlib.contextmanager
def _cluster_lock() -> Iterator[None]:
    with open("/tmp/qgtrain-slurm.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _cluster_users() -> dict[str, Any]:
    """Who uses the cluster now: workers that have died (a killed test run) are left out."""
    try:
        users = json.loads(CLUSTER_USERS.read_text())
    except (OSError, ValueError):
        users = {}
    pids = [pid for pid in users.get("pids", []) if Path(f"/proc/{pid}").exists()]
    return {"run": users.get("run"), "pids": pids}


def _start_cluster() -> None:
    started = subprocess.run(
        ["bash", str(CLUSTER / "start.sh"), "--nodes", "5", "--side", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if started.returncode != 0:
        pytest.fail(f"could not start the Slurm test cluster:\n{started.stdout}\n{started.stderr}")


# Set by pytest for each phase of a test, and by torch on first use of inductor: harmless to
# inherit.
LIBRARIES_OWN = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR"}


@pytest.fixture(autouse=True)
def environment_left_as_found() -> Iterator[None]:
    """A test that changes os.environ without monkeypatch changes every later test's and every Slurm
    job's environment (sbatch exports it): a leaked GLOO_SOCKET_IFNAME once failed every multi-node
    test. Such a test fails, and the environment is put back."""
    before = dict(os.environ)
    yield
    changed = sorted(
        key
        for key in before.keys() | os.environ.keys()
        if before.get(key) != os.environ.get(key) and key not in LIBRARIES_OWN
    )
    os.environ.clear()
    os.environ.update(before)
    if changed:
        pytest.fail(
            f"the test left the environment changed ({', '.join(changed)}): use monkeypatch"
        )


@pytest.fixture(scope="session")
def two_node_reference(
    slurm_cluster: Path, tmp_path_factory: pytest.TempPathFactory
) -> Mapping[str, Any]:
    """The final weights of the uninterrupted two-node run (helpers.two_node_configs), trained once
    for every test whose interrupted run must end equal to it: submitted when first asked for and
    waited for when first read, so it trains beside the first such test's own job."""
    from tests.helpers import (
        TWO_NODE_STEPS,
        TWO_NODES,
        JobWeights,
        sbatch,
        two_node_configs,
    )

    tmp = tmp_path_factory.mktemp("two-node-reference")
    job_id = sbatch(tmp, *TWO_NODES, "--time=10", configs=two_node_configs(tmp))
    return JobWeights(job_id, tmp / "runs" / "cpu", TWO_NODE_STEPS)


@pytest.fixture
def root() -> None:
    """For tests that mount filesystems or make namespaces."""
    if os.geteuid() != 0:
        _cannot_start("mounts and namespaces need root", what="the filesystem fault tests")


@pytest.fixture
def small_disk(tmp_path: Path, root: None) -> Iterator[Path]:
    """A real 1 MB tmpfs mounted for the test (root only): a disk that fills up, and can be made
    read-only with `mount -o remount,ro`."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _cannot_start(reason: str, what: str = "the Slurm tests") -> None:
    if os.environ.get("CI"):
        pytest.fail(f"CI must run {what}, but {reason}")
    pytest.skip(reason)
