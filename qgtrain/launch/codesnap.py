"""The code a job runs: a copy of the submit directory and of qgtrain, taken when the job is
submitted.

A job waits in the queue, and is requeued after preemptions, while its user edits the task module or
qgtrain itself; each attempt would otherwise run whatever is on disk when it starts. The copy lives
in `<run dir>/code/<hash>/` (`submit/`: the submit directory's files; `lib/qgtrain/`: the package;
`snapshot.json`: the git commit, the diff and the hash). It is content-addressed: submitting
unchanged code again finds the folder (after checking it: snapseal.verify) and copies nothing.
Files that may hold a credential, by their name or their text, are left out (secretfiles.py).
No torch here.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..foundation.errors import ConfigError
from ..runs.rundir import create, is_run_dir
from .secretfiles import secret_in_text, why_left_out
from .snapseal import RECORD as RECORD
from .snapseal import entries_digest, remove, seal, verify

KINDS_WITHOUT_GIT = (".py", ".yaml", ".yml", ".sh", ".json", ".toml")
DIFF_CAP = 200_000  # characters of `git diff HEAD` kept in snapshot.json
SKIPPED_DIRS = ("__pycache__",)


@dataclass(frozen=True)
class Code:
    """A snapshot on disk: where the job's working directory and its PYTHONPATH entries are."""

    folder: Path
    digest: str
    # the submit directory's files left out and why (secretfiles.why_left_out), for submit to name
    skipped: tuple[tuple[str, str], ...] = field(default=(), compare=False)
    # the folder it was taken from, which a submitted job runs in (runfrom.shell_lines)
    submit_dir: Path | None = field(default=None, compare=False)

    @property
    def workdir(self) -> Path:
        return self.folder / "submit"

    @property
    def lib(self) -> Path:
        return self.folder / "lib"

    @property
    def pythonpath(self) -> str:
        return f"{self.lib}:{self.workdir}"


@dataclass(frozen=True)
class Files:
    """What a snapshot copies: (name in the snapshot, where it is now), in name order."""

    entries: list[tuple[str, Path]]
    git: bool
    skipped: tuple[tuple[str, str], ...] = ()  # (name, why it was left out)


def package_dir() -> Path:
    return Path(__file__).resolve().parents[1]


def collect(
    submit_dir: Path, leave_out: tuple[Path, ...] = (), exclude: tuple[str, ...] = ()
) -> Files:
    """The submit directory's files (with git: tracked and untracked-but-not-ignored ones; without:
    the Python, YAML, shell, JSON and TOML files below it) and qgtrain's. Folders in `leave_out`
    (the runs, Slurm's output) are never code, even when no .gitignore says so; files that may
    hold a secret, or that `exclude` (slurm.snapshot_exclude) names, are left out and listed with
    why."""
    submit_dir = submit_dir.resolve()
    listed = _git_files(submit_dir)
    names = listed if listed is not None else _plain_files(submit_dir)
    not_code = [p.resolve() for p in leave_out]
    kept = [
        name
        for name in names
        if _is_entry(submit_dir / name) and not _under(submit_dir / name, not_code)
    ]
    secret = {name: why for name in kept if (why := why_left_out(name, submit_dir / name, exclude))}
    entries = [(f"submit/{name}", submit_dir / name) for name in kept if name not in secret]
    package = package_dir()
    entries += [
        (f"lib/qgtrain/{path.relative_to(package)}", path)
        for path in _walk(package)
        if path.suffix != ".pyc"
    ]
    return Files(sorted(entries), listed is not None, tuple(sorted(secret.items())))


def _is_entry(path: Path) -> bool:
    """A file, or a link, which the snapshot keeps as a link: what it points at (data, a key in the
    home folder) is never read or copied into the run directory."""
    return path.is_symlink() or path.is_file()


def _under(path: Path, folders: list[Path]) -> bool:
    resolved = path.resolve()
    return any(resolved == f or f in resolved.parents for f in folders)


def _git_files(folder: Path) -> list[str] | None:
    try:
        done = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard", "-z"],
            cwd=folder,
            capture_output=True,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    listed = done.stdout.decode(errors="surrogateescape").split("\0")
    return sorted({name for name in listed if name})


def _plain_files(folder: Path) -> list[str]:
    return [
        str(path.relative_to(folder)) for path in _walk(folder) if path.suffix in KINDS_WITHOUT_GIT
    ]


def _walk(folder: Path) -> list[Path]:
    """Files below `folder`, leaving out hidden folders (.git, .venv), caches and runs (a run's json
    files are no code, and a run elsewhere than logging.runs_dir is still a run)."""
    found = []
    for parent, dirs, files in os.walk(folder):
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".") and d not in SKIPPED_DIRS and not is_run_dir(Path(parent, d))
        )
        found += [Path(parent, name) for name in sorted(files)]
    return found


def digest(files: Files) -> str:
    """The hash of the file names and contents: the snapshot's folder name, which its copy hashes
    to again (snapseal.verify)."""
    return entries_digest(files.entries)


def check_size(files: Files, max_mb: float) -> int:
    """The snapshot's size in bytes; refused (naming the largest files) above
    slurm.snapshot_max_mb."""
    sizes = sorted(((path.lstat().st_size, name) for name, path in files.entries), reverse=True)
    total = sum(size for size, _ in sizes)
    if total > max_mb * 1e6:
        largest = ", ".join(f"{name.partition('/')[2]} ({_mb(size)})" for size, name in sizes[:3])
        raise ConfigError(
            f"slurm.snapshot_max_mb: the code snapshot would be {_mb(total)}, "
            f"over the cap of {max_mb:g} MB; largest: {largest}. HINT: list data "
            "and outputs in .gitignore or move them out of the submit directory, "
            "raise slurm.snapshot_max_mb, or set slurm.snapshot: false"
        )
    return total


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.1f} kB"


def take(
    submit_dir: Path,
    code_dir: Path,
    max_mb: float,
    leave_out: tuple[Path, ...] = (),
    shared: bool = False,
    exclude: tuple[str, ...] = (),
) -> Code:
    """The snapshot of `submit_dir` under `code_dir` (<run dir>/code): found by its hash and
    verified, or copied there (into a private temporary folder, sealed read-only and renamed into
    place, so a half copy is never used). The size is checked before anything is written; the run
    directory is made as a run makes it (rundir.create)."""
    files = collect(submit_dir, leave_out, exclude)
    size = check_size(files, max_mb)
    name = digest(files)
    target = code_dir / name
    if os.path.lexists(target):
        verify(target)
        return Code(target, name, files.skipped, submit_dir.resolve())
    create(code_dir.parent, shared)
    private_folder(code_dir, shared)
    staging = code_dir / f".tmp-{secrets.token_hex(6)}"
    staging.mkdir(mode=0o700)
    try:
        for relative, source in files.entries:
            (staging / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, staging / relative, follow_symlinks=False)
        record = {
            "hash": name,
            "submit_dir": str(submit_dir.resolve()),
            "files": len(files.entries),
            "bytes": size,
            "created": time.time(),
            "git": files.git,
            "left_out": [name for name, _ in files.skipped],
            **_git_state(submit_dir, [name for name, _ in files.skipped]),
        }
        (staging / RECORD).write_text(json.dumps(record, indent=1))
        seal(staging, shared)
        staging.rename(target)
    except OSError:
        remove(staging)
        if not os.path.lexists(target):
            raise
    verify(target)  # another submit may have made the same snapshot first
    return Code(target, name, files.skipped, submit_dir.resolve())


def private_folder(folder: Path, shared: bool) -> None:
    """Make `folder` (code/, code/jobs/) if missing, 0700 (0750 for a shared run) whatever the
    umask: a folder a job runs from is never writable by the group."""
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        return  # made before: whose it is, and its mode, are the run folder's rule (rundir)
    folder.chmod(stat.S_IRWXU | (0o050 if shared else 0))


def _git_state(folder: Path, left_out: list[str]) -> dict[str, object]:
    """The commit and `git diff HEAD` (capped) the snapshot was taken from; empty outside git. The
    diff leaves out the files the snapshot leaves out, and is dropped whole, saying why, if what
    remains still holds a token (one taken out of a tracked file is in its removed lines)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", *args],
                cwd=folder,
                capture_output=True,
                text=True,
                timeout=60,
                errors="replace",
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {}
    diff = git("diff", "HEAD", "--", *(f":(exclude,literal){name}" for name in left_out)) or ""
    if found := secret_in_text(diff.encode()):
        why = f"it holds what looks like {found}"
        return {"commit": commit.strip(), "diff": "", "diff_left_out": why}
    return {
        "commit": commit.strip(),
        "diff": diff[:DIFF_CAP],
        "diff_truncated": len(diff) > DIFF_CAP,
    }


def read_record(code: Path) -> dict[str, object]:
    try:
        record = json.loads((code / RECORD).read_text())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}
