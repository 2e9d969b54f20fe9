"""Running a job from its code snapshot: the config it trains with, and the shell lines that move it
there.

The job's working directory is the snapshot's copy of the submit directory (Python puts the working
directory first on sys.path under `python -m`, so the live copy can never shadow the snapshot) and
PYTHONPATH starts with the snapshot's qgtrain and submit directory. What the config names relative
to the submit directory (runs, data, caches, exports, pretrained models) is made absolute against it
at submit, so it still means the same files; a factory given as a file in the submit directory is
pointed at the snapshot's copy. The job's config is written whole at submit, so an edited config
file changes nothing after that either. No torch here.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..config.load import config_from_dict, config_to_dict, dump_yaml
from ..foundation.files import write_atomic
from ..state.rundir import RunDir, default_run_dir
from .codesnap import Code, check_size, collect, digest, take
from .sbatch import snapshots

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


def leave_out(cfg: RunConfig, submit_dir: Path) -> tuple[Path, ...]:
    """What is never code: the runs (checkpoints, snapshots) and Slurm's output files."""
    return tuple((submit_dir / p).resolve() for p in (cfg.logging.runs_dir, cfg.slurm.output_dir))


def planned(cfg: RunConfig, submit_dir: Path, code_dir: Path) -> Code:
    """Where the snapshot would be, its size checked, nothing copied (`qgtrain submit
    --dry-run`)."""
    files = collect(submit_dir, leave_out(cfg, submit_dir))
    check_size(files, cfg.slurm.snapshot_max_mb)
    name = digest(files)
    return Code(code_dir / name, name)


def snapshot(cfg: RunConfig, submit_dir: Path, code_dir: Path) -> Code:
    return take(
        submit_dir,
        code_dir,
        cfg.slurm.snapshot_max_mb,
        leave_out(cfg, submit_dir),
        cfg.logging.shared,
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
    """What a batch script runs before its first srun to run from `code`."""
    return (
        f"cd {shlex.quote(str(code.workdir))} || exit 1"
        "  # the code as submitted (slurm.snapshot)\n"
        f'export PYTHONPATH={shlex.quote(code.pythonpath)}"${{PYTHONPATH:+:$PYTHONPATH}}"\n'
    )


def for_attempt(cfg: RunConfig, job: str, submit_dir: Path) -> tuple[Code, Path] | None:
    """train.slurm's snapshot (`qgtrain snapshot`): taken at the job's first start, reused by every
    later one (requeues) through `<run dir>/code/jobs/<job>.json`; None with slurm.snapshot off.
    Returns the snapshot and the job's config file."""
    if not snapshots(cfg.slurm):
        return None
    code_dir = RunDir(default_run_dir(job_config_paths(cfg, submit_dir)).resolve()).code
    record = code_dir / "jobs" / f"{job or 'local'}.json"
    try:
        known = json.loads(record.read_text())
        return Code(Path(known["code"]), known["hash"]), Path(known["config"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    code = snapshot(cfg, submit_dir, code_dir)
    config = record.with_suffix(".yaml")
    record.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(config, dump_yaml(job_config(cfg, submit_dir, code)))
    write_atomic(
        record, json.dumps({"code": str(code.folder), "hash": code.digest, "config": str(config)})
    )
    return code, config


def job_config_paths(cfg: RunConfig, submit_dir: Path) -> RunConfig:
    """Only the run directory's place, anchored: enough to find a job's record before any
    snapshot."""
    runs = Path(cfg.logging.runs_dir)
    if runs.is_absolute():
        return cfg
    values = config_to_dict(cfg)
    values["logging"]["runs_dir"] = str(submit_dir.resolve() / runs)
    return config_from_dict(values, "the submitted config")
