"""Running a job from its code snapshot: the config it trains with, and the shell lines that put the
snapshot first on its path.

The job runs in the folder it was submitted from, so what its task opens by a relative path is
what it meant at submit, and PYTHONPATH starts with the snapshot's qgtrain and submit directory;
PYTHONSAFEPATH keeps that folder itself off the front of sys.path, so its live modules never shadow
the snapshot's (submit_host.snapshot_first). What the config names relative to the submit directory
(runs, data, caches, exports, pretrained models) is made absolute against it at submit, so it still
means the same files; a factory given as a file in the submit directory is pointed at the
snapshot's copy. The job's config is written whole at submit, so an edited config file changes
nothing after that either.

Whatever a job runs is checked first, where someone else may have written it: the snapshot must hash
to its name and be the user's alone (snapseal.verify), at submit and at every start, and a job
record (`code/jobs/<job>.json`, train.slurm's) counts only if it names this run's own snapshot, with
its config beside it, all the user's alone. No torch here.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..config.load import config_from_dict, config_to_dict, dump_yaml
from ..config.slurm import runs_from_snapshot
from ..foundation.errors import ConfigError
from ..foundation.files import temp_name
from ..foundation.terminal import shown
from ..foundation.trust import not_yours
from ..runs.rundir import RunDir, default_run_dir, require_safe
from .codesnap import Code, check_size, collect, digest, private_folder, take
from .snapseal import HASH_NAME, SnapshotChanged, verify
from .submit_host import snapshot_first, submitting_python

ALWAYS_PATHS = (
    "logging.runs_dir",
    "data.cache_dir",
    "export.dir",
    "slurm.output_dir",
    "model.pretrained",
)
KEYWORDS = {
    "data.corpus": ("stdlib",),
    "data.tokenizer": ("byte",),
    "checkpoint.resume": ("auto", "never"),
}
PATH_LISTS = ("data.files", "data.val_files", "data.test_files")
_FACTORY = re.compile(r"(/.+\.py):([A-Za-z_][A-Za-z0-9_.]*)")
_JOB_ID = re.compile(r"[A-Za-z0-9_.-]+")
NAMED_AT_MOST = 20  # left-out files named at submit


def leave_out(cfg: RunConfig, submit_dir: Path) -> tuple[Path, ...]:
    """What is never code: the runs (checkpoints, snapshots) and Slurm's output files."""
    return tuple((submit_dir / p).resolve() for p in (cfg.logging.runs_dir, cfg.slurm.output_dir))


def planned(cfg: RunConfig, submit_dir: Path, code_dir: Path) -> Code:
    """Where the snapshot would be, its size checked, nothing copied (`qgtrain submit
    --dry-run`)."""
    files = collect(submit_dir, leave_out(cfg, submit_dir), cfg.slurm.snapshot_exclude)
    check_size(files, cfg.slurm.snapshot_max_mb)
    name = digest(files)
    say_left_out(files.skipped)
    return Code(code_dir / name, name, files.skipped, submit_dir.resolve())


def snapshot(cfg: RunConfig, submit_dir: Path, code_dir: Path) -> Code:
    code = take(
        submit_dir,
        code_dir,
        cfg.slurm.snapshot_max_mb,
        leave_out(cfg, submit_dir),
        cfg.logging.shared,
        cfg.slurm.snapshot_exclude,
    )
    say_left_out(code.skipped)
    return code


def say_left_out(skipped: tuple[tuple[str, str], ...]) -> None:
    """One line on stderr naming the files the snapshot left out and why (a file left out for its
    text: which kind of token it seems to hold, never the token), so a job that needed one fails
    with its name already on screen. Names are escaped: a file's name is anyone's text."""
    if not skipped:
        return
    grouped: dict[str, list[str]] = {}
    for name, why in skipped[:NAMED_AT_MOST]:
        grouped.setdefault(why, []).append(shown(name))
    listed = "; ".join(f"{', '.join(names)} ({why})" for why, names in grouped.items())
    more = f"; and {len(skipped) - NAMED_AT_MOST} more" if len(skipped) > NAMED_AT_MOST else ""
    print(
        f"qgtrain: the code snapshot leaves out {listed}{more}; a job reads such files from "
        "where they are",
        file=sys.stderr,
    )


def job_config(cfg: RunConfig, submit_dir: Path, code: Code) -> RunConfig:
    """`cfg` as the job runs it from `code`: relative paths anchored at the submit directory, file
    factories inside it pointed at the snapshot's copy."""
    submit_dir = submit_dir.resolve()
    values = config_to_dict(cfg)

    def anchored(text: str) -> str:
        return text if not text or Path(text).is_absolute() else str(submit_dir / text)

    for key in (*ALWAYS_PATHS, *KEYWORDS):
        section, name = key.split(".")
        value = values[section][name]
        if isinstance(value, str) and value not in KEYWORDS.get(key, ()):
            values[section][name] = anchored(value)
    for key in PATH_LISTS:
        section, name = key.split(".")
        values[section][name] = [anchored(v) for v in values[section][name]]
    return config_from_dict(_moved_factories(values, submit_dir, code), "the submitted config")


def _moved_factories(values: Any, submit_dir: Path, code: Code) -> Any:
    if isinstance(values, dict):
        return {k: _moved_factories(v, submit_dir, code) for k, v in values.items()}
    if isinstance(values, list):
        return [_moved_factories(v, submit_dir, code) for v in values]
    if isinstance(values, str) and (match := _FACTORY.fullmatch(values)):
        file = Path(match.group(1))
        if submit_dir in file.parents:
            return f"{code.workdir / file.relative_to(submit_dir)}:{match.group(2)}"
    return values


def shell_lines(code: Code) -> str:
    """What a batch script runs before its first srun to run from `code`: first `qgtrain snapshot
    --verify` with the batch shell's own Python, from the submit directory (never the snapshot's
    qgtrain, which is what is checked), or the submitting Python where the script names none
    (submitit's); then the job stays in the submit directory, where relative paths mean what they
    meant at submit, with the snapshot first on sys.path (submit_host.snapshot_first)."""
    where = code.submit_dir or Path.cwd()  # a snapshot taken here (take, planned) records it
    return (
        f"verify_python=${{RECOVER_PYTHON:-{shlex.quote(submitting_python())}}}\n"
        f'"$verify_python" -m qgtrain snapshot --verify {shlex.quote(str(code.folder))} || exit 2'
        "  # changed since submit: nothing runs\n"
        f"cd {shlex.quote(str(where))} || exit 1"
        "  # submitted here: relative paths mean what they meant then\n"
        + snapshot_first('"$verify_python"', shlex.quote(str(code.workdir)))
        + f'export PYTHONPATH={shlex.quote(code.pythonpath)}"${{PYTHONPATH:+:$PYTHONPATH}}"'
        "  # the code as submitted (slurm.snapshot)\n"
    )


def code_of(script: Path) -> str | None:
    """The code snapshot a rendered job script runs from, if any (what `qgtrain submit` prints)."""
    try:
        match = re.search(
            r" -m qgtrain snapshot --verify (.+) \|\| exit 2", script.read_text(), re.MULTILINE
        )
    except OSError:
        return None
    return shlex.split(match.group(1))[0] if match else None


def for_attempt(cfg: RunConfig, job: str, submit_dir: Path) -> tuple[Code, Path] | None:
    """train.slurm's snapshot (`qgtrain snapshot`): taken at the job's first start, reused by every
    later one (requeues) through `<run dir>/code/jobs/<job>.json`; None with slurm.snapshot off.
    Returns the snapshot, verified, and the job's config file."""
    if not runs_from_snapshot(cfg.slurm):
        return None
    if not _JOB_ID.fullmatch(job or "local"):
        raise ConfigError(f"--job {job!r}: not a Slurm job id")
    code_dir = RunDir(default_run_dir(job_config_paths(cfg, submit_dir)).resolve()).code
    pin = require_safe(code_dir.parent)  # its job records and snapshot run as the user
    record = code_dir / "jobs" / f"{job or 'local'}.json"
    known = recorded(record, code_dir)
    if known:
        if pin is not None:
            pin.check()  # the folder checked still holds the snapshot the job is sent to
        return known
    code = snapshot(cfg, submit_dir, code_dir)
    config = record.with_suffix(".yaml")
    private_folder(record.parent, cfg.logging.shared)
    shared = cfg.logging.shared
    write_private(config, dump_yaml(job_config(cfg, submit_dir, code)), shared)
    made = {"code": str(code.folder), "hash": code.digest, "config": str(config)}
    write_private(record, json.dumps(made), shared)
    if pin is not None:
        pin.check()
    return code, config


def verified(folder: Path) -> None:
    """`qgtrain snapshot --verify`, which a job script runs before it moves into the snapshot:
    the run folder holding it checked as at a start (its submitit/ pickles too, which submitit
    unpickles next), the snapshot, and then that the run folder is still the one checked."""
    run = folder.parent.parent if folder.parent.name == "code" else None
    pin = require_safe(run) if run is not None else None
    verify(folder)
    if pin is not None:
        pin.check()


def recorded(record: Path, code_dir: Path) -> tuple[Code, Path] | None:
    """The snapshot and config a job record names; None if there is no record yet. A record counts
    only if it, its config beside it and the folders down to them are the user's alone, and it
    names `code_dir/<hash>` itself (no link on the way), whose files hash to that name; anything
    else could be a colleague's record naming their code, and is refused."""
    if not os.path.lexists(record):
        return None
    config = record.with_suffix(".yaml")
    folder, problem = _named_snapshot(record, code_dir)
    problem = problem or not_yours(code_dir, config)
    if problem or folder is None:
        raise SnapshotChanged(
            f"the job record {record}: {problem}; the code it names is not run. HINT: if "
            f"you did not write it, remove it and submit the job again; keep {code_dir.parent} "
            "writable by you alone"
        )
    verify(folder)
    return Code(folder, folder.name), config


def _named_snapshot(record: Path, code_dir: Path) -> tuple[Path | None, str | None]:
    """The snapshot folder the record names, or why the record does not count."""
    problem = not_yours(code_dir, record)
    if problem:
        return None, problem
    try:
        known = json.loads(record.read_text())
        folder, name, config = Path(known["code"]), known["hash"], Path(known["config"])
    except (OSError, ValueError, KeyError, TypeError):
        return None, "is not a job record qgtrain wrote"
    if not isinstance(name, str) or not HASH_NAME.fullmatch(name):
        return None, "is not a job record qgtrain wrote"
    if folder != code_dir / name or folder.resolve() != folder:
        return None, f"names {folder}, not a snapshot of this run ({code_dir}/<hash>)"
    if config != record.with_suffix(".yaml"):
        return None, f"names the config {config}, not {record.with_suffix('.yaml')}"
    return folder, None


def write_private(path: Path, text: str, shared: bool) -> None:
    """Write `path` whole (renamed into place) as 0600, or 0640 for a shared run, whatever the
    umask: a job's record and config decide what it runs."""
    mode = 0o640 if shared else 0o600
    tmp = temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def job_config_paths(cfg: RunConfig, submit_dir: Path) -> RunConfig:
    """Only the run directory's place, anchored: enough to find a job's record before any
    snapshot."""
    runs = Path(cfg.logging.runs_dir)
    if runs.is_absolute():
        return cfg
    values = config_to_dict(cfg)
    values["logging"]["runs_dir"] = str(submit_dir.resolve() / runs)
    return config_from_dict(values, "the submitted config")
