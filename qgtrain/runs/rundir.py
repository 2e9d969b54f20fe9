"""The run directory: where it is, what it holds, which run it belongs to, and who may write it.

    config.yaml        the resolved config of the latest start
    run.json           the run id that checkpoints are matched against, across requeues
    status.json        what rank 0 last recorded: running, finished, stopped early, preempted,
                       failed
    metrics.jsonl      one JSON object per logged step (rank 0)
    logs/rank_<N>.log  every rank's log, appended across restarts
    tb/                TensorBoard events
    checkpoints/       step-<N>/ folders (layout.py draws one)
    profiles/          torch.profiler traces of train.profile_steps
    eval/              downstream tasks' samples (step-<N>.jsonl) and results.jsonl
    .lock              held by the rank 0 that is training in it
    slurm/             the job `qgtrain submit` wrote: its config.yaml and job.sbatch
    code/              the code snapshot jobs run from (slurm.snapshot)
    stages/            a chain's later stages (`qgtrain submit --then`)
    compile-cache/     each rank's inductor cache (runtime/compile_cache.py)
    submitit/          submitit's pickled jobs and logs (qgtrain.submit)

The directory follows from the config alone (<logging.runs_dir>/<train.run_name>), so a requeued job
finds it again without being told. A folder that holds anything but a run is refused
(refuse_foreign): a run writes config.yaml, logs and checkpoints, which would land among, or over,
what is there. It holds the config, logs and weights of someone's work, on filesystems every user of
a cluster can read: qgtrain creates it private (see `create`), and writes or runs jobs in one only
when no one else can write it (`require_safe`, access.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import stat
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..config import RunConfig
from ..foundation.errors import QgtrainError
from ..foundation.files import open_lock, read_holder, try_lock, write_atomic, write_holder
from ..foundation.pinned import Pinned
from ..foundation.trust import open_above
from ..state import layout
from . import access


@dataclass(frozen=True)
class RunDir:
    """A run directory's layout: the one place where the names of what it holds are spelled."""

    path: Path

    @property
    def config(self) -> Path:
        return self.path / layout.CONFIG  # the same name as a checkpoint's copy

    @property
    def run_file(self) -> Path:
        return self.path / "run.json"

    @property
    def status(self) -> Path:
        return self.path / "status.json"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def logs(self) -> Path:
        return self.path / "logs"

    def rank_log(self, rank: int) -> Path:
        return self.logs / f"rank_{rank}.log"

    def failure_note(self, rank: int) -> Path:
        return self.logs / f"failed-rank-{rank}.txt"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tb"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def profiles(self) -> Path:
        """torch.profiler traces of train.profile_steps (training/profiling.py)."""
        return self.path / "profiles"

    @property
    def nccl_dumps(self) -> Path:
        """The prefix of NCCL's Flight Recorder dumps, <prefix><rank> (comms.keep_nccl_dumps)."""
        return self.path / "nccl" / "rank_"

    @property
    def trackers(self) -> Path:
        return self.path / "trackers.json"

    @property
    def eval(self) -> Path:
        return self.path / "eval"

    @property
    def export(self) -> Path:
        return self.path / "export"

    @property
    def lock(self) -> Path:
        return self.path / ".lock"

    @property
    def slurm(self) -> Path:
        return self.path / "slurm"

    @property
    def code(self) -> Path:
        return self.path / "code"

    @property
    def stages(self) -> Path:
        return self.path / "stages"

    @property
    def compile_cache(self) -> Path:
        return self.path / "compile-cache"

    @property
    def submitit(self) -> Path:
        return self.path / "submitit"


# What qgtrain itself puts in a run directory before run.json records the run: the lock (a start
# waiting for another, or killed before it recorded the run), the job's files of `qgtrain submit`
# (slurm/, the code snapshot code/, a chain's stages/) and of submitit (submitit/), the status
# `qgtrain recover` records when a first start failed, and leftovers <name>.tmp-<random> of these
# and of run.json, from a write cut short.
BEFORE_THE_RUN = frozenset(
    {".lock", "slurm", "submitit", "status.json", "run.json", "code", "stages"}
)


def default_run_dir(cfg: RunConfig) -> Path:
    return Path(cfg.logging.runs_dir) / cfg.train.run_name


def folder_mode(shared: bool) -> int:
    """The mode of a folder qgtrain makes inside a run directory (the umask may take more away)."""
    return 0o750 if shared else 0o700


def create(path: Path, shared: bool) -> str | None:
    """Make the run directory's top folder if it is missing: private to its owner (0700), or with
    logging.shared readable by its group (0750), set after mkdir, whose mode the umask filters (002
    made a group-writable one). A folder that exists keeps its mode (the user, or a qgtrain before
    0700, chose it; require_safe refuses one others can write): one others can read is named in the
    returned warning."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
        # keeps a set-group-ID bit inherited from a group project folder
        os.chmod(path, (path.stat().st_mode & stat.S_ISGID) | folder_mode(shared))
        return None
    except FileExistsError:
        mode = path.stat().st_mode & 0o777
    if shared or not mode & 0o007:
        return None
    return (
        f"the run directory {path} is open to other users (mode {mode:04o}); qgtrain "
        f"leaves the mode of a folder it finds. HINT: chmod 700 {path}, or set "
        "logging.shared: true if it is meant to be"
    )


def require_safe(path: Path, warn: Callable[[str], None] | None = None) -> Pinned | None:
    """Refuse a run directory someone else can write into, before anything is written or run there:
    its job files (slurm/, stages/, code/) run at every start, requeue and next stage, so do
    compile-cache/ (inductor's generated Python) and submitit/ (pickles); and qgtrain writes by
    predictable names all over it. logging.shared lets the group read, never write. The folders
    above it are judged as ssh judges those above ~/.ssh (trust.open_above); a warning goes to
    `warn` (stderr by default). Returns the folder as pinned before it was checked (None where
    there is none yet): a use that matters checks the path still names it (Pinned.check)."""
    run = RunDir(path)
    try:
        pin: Pinned | None = Pinned.now(path)
    except OSError:
        pin = None
    refusal, warning = open_above(path)
    if refusal:
        raise QgtrainError(
            f"the run directory {path} is not safe to write or run jobs in: {refusal}"
        )
    if warning:
        (warn or _say)(warning)
    job_files = (run.slurm, run.stages, run.code / "jobs")  # never a link
    code = (run.compile_cache, run.submitit)  # links lead back inside
    found = access.problem(path, (run.slurm, run.stages, run.code, *code), job_files, code)
    if found is None:
        return pin
    if found.info is None:
        fix = f"check who can read and write {found.path}"
    elif found.info.st_uid != os.getuid():
        fix = f"remove it, or choose another train.run_name (or --run-dir) than {path}"
    elif stat.S_ISLNK(found.info.st_mode):
        fix = f"remove the link {found.path}"
    else:
        fix = f"chmod -R g-w,o-w {path} (once you checked that no one else changed its files)"
    raise QgtrainError(
        f"the run directory {path} is not safe to write or run jobs in: {found.why} (owner "
        f"{found.owner}, mode {found.mode}); others could change the job files that a start or "
        f"a requeue runs as you. HINT: {fix}"
    )


def _say(line: str) -> None:
    print(f"qgtrain: warning: {line}", file=sys.stderr)


def is_run_dir(path: Path) -> bool:
    return RunDir(path).run_file.exists()


def refuse_foreign(path: Path) -> None:
    """Refuse a folder that is neither new, nor empty, nor a run (nor one that qgtrain started and
    has not yet recorded): `--run-dir .` must not write over the user's own config.yaml."""
    if not path.is_dir() or is_run_dir(path):
        return
    foreign = sorted(
        entry.name
        for entry in path.iterdir()
        if entry.name.partition(".tmp-")[0] not in BEFORE_THE_RUN
    )
    if foreign:
        shown = ", ".join(map(repr, foreign[:3]))
        shown += f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise QgtrainError(
            f"{path} is not a run directory (it has no run.json) and holds "
            f"other files ({shown}), which a run would write among or over. "
            "HINT: give --run-dir (or logging.runs_dir and train.run_name) a new or "
            "empty folder, or the directory of an existing run"
        )


def read_run_id(run_dir: Path) -> str | None:
    try:
        return str(json.loads(RunDir(run_dir).run_file.read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def open_run(run_dir: Path, cfg: RunConfig, config_yaml: str) -> str:
    """Record the resolved config; return this run's id: the recorded one, or a new one for a fresh
    start."""
    run = RunDir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    previous = read_run_id(run_dir)
    run_id = previous if previous and cfg.checkpoint.resume != "never" else uuid.uuid4().hex[:12]
    if run_id != previous:
        if previous and run.metrics.exists():  # a fresh start keeps the earlier run's history
            run.metrics.rename(run_dir / f"metrics.{previous}.jsonl")
        write_atomic(
            run.run_file,
            json.dumps({"run_id": run_id, "run_name": cfg.train.run_name, "created": time.time()}),
        )
    # After run.json: a config.yaml without a run.json is never qgtrain's (refuse_foreign)
    write_atomic(run.config, config_yaml)
    return run_id


@contextlib.contextmanager
def exclusive(run_dir: Path, owner: str, wait_s: float = 60.0) -> Iterator[None]:
    """Hold the run directory's lock; fail clearly if another job keeps it longer than `wait_s`.

    A requeued job may start while its previous allocation is still exiting, hence the wait.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = open_lock(RunDir(run_dir).lock, 0o600)
    try:
        deadline = time.monotonic() + wait_s
        while try_lock(fd) is False:  # None: a filesystem without locks, used unguarded
            if time.monotonic() > deadline:
                holder = read_holder(fd) or "another process"
                raise QgtrainError(
                    f"run directory {run_dir} is in use by {holder}. HINT: wait for that job "
                    "to end, or give this one another --run-dir or train.run_name"
                ) from None
            time.sleep(0.5)
        write_holder(fd, f"{owner} (pid {os.getpid()} on {socket.gethostname()})")
        yield
    finally:
        os.close(fd)


def write_status(run_dir: Path, status: str | None, **facts: object) -> None:
    """Record the run's state for `qgtrain runs` (rank 0, atomically); facts are merged into the
    last record. `status` None keeps the state recorded."""
    record = read_status(run_dir)
    record.update(facts, updated=time.time())
    record["status"] = status or record.get("status", "running")
    write_atomic(RunDir(run_dir).status, json.dumps(record))


def read_status(run_dir: Path) -> dict[str, object]:
    try:
        record = json.loads(RunDir(run_dir).status.read_text())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def is_locked(run_dir: Path) -> bool | None:
    """Whether a process holds the run directory's lock now (None where the filesystem cannot
    say)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # no link, no FIFO wait
    try:
        fd = os.open(RunDir(run_dir).lock, flags)
    except PermissionError:  # another user's run in a shared folder: its lock is not ours to read
        return None
    except OSError:
        return False
    try:
        taken = try_lock(fd, shared=True)
        return None if taken is None else not taken
    finally:
        os.close(fd)


def unwritable(path: Path, exc: OSError) -> QgtrainError:
    """The refusal of a run directory that cannot be written, naming what failed."""
    return QgtrainError(
        f"the run directory {path} cannot be written ({exc.strerror or exc}: "
        f"{exc.filename or path}). HINT: choose a writable place with --run-dir or "
        "logging.runs_dir, or free space there"
    )
