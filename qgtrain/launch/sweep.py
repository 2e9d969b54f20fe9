"""Sweeps: every combination of swept config values as one task of one Slurm job array. No torch
here.

`--sweep optim.lr=1e-3,3e-4 --sweep train.seed=1,2` gives four tasks, in the order the keys were
given (the last varies fastest). Every combination is built and checked as a config before anything
is submitted, so a bad key or value is one error and no job. Each task has its own run, named after
its values (`tiny-gpt2-lr_1e-3-seed_1`), and is requeued on its own like any qgtrain job
(train.slurm and the trainer name the array task). The sweep's folder, `<runs_dir>/.sweeps/<run
name>/`, holds each task's config and `sweep.json`, from which `qgtrain runs` shows the swept values
beside the metrics.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import RunConfig
from ..config.load import dump_yaml, with_overrides
from ..config.slurm import runs_from_snapshot
from ..foundation.errors import ConfigError, QgtrainError
from ..foundation.files import write_atomic
from ..runs import rundir
from .sbatch import Runner

if TYPE_CHECKING:
    from .codesnap import Code

FILE = "sweep.json"
DEFAULT_MAX_ARRAY_SIZE = 1001  # Slurm's default MaxArraySize


@dataclass(frozen=True)
class Sweep:
    name: str
    keys: list[str]
    values: list[dict[str, str]]  # per task: key -> value as given
    configs: list[RunConfig]  # per task: the base config with its values and run name


def parse(options: Sequence[str]) -> list[tuple[str, list[str]]]:
    """`KEY=v1,v2` options as (key, values), each key once and with at least one value."""
    axes: list[tuple[str, list[str]]] = []
    for option in options:
        key, sep, text = option.partition("=")
        values = [v.strip() for v in text.split(",")] if sep else []
        if not key.strip() or not values or any(not v for v in values):
            raise ConfigError(
                f"--sweep {option!r}: expected KEY=VALUE[,VALUE...], e.g. --sweep "
                "optim.lr=1e-3,3e-4"
            )
        if key in (k for k, _ in axes):
            raise ConfigError(f"--sweep {key}: given twice; list all its values in one --sweep")
        if key == "train.run_name":
            raise ConfigError(
                "--sweep train.run_name: each task's run name is made from its values"
            )
        axes.append((key.strip(), values))
    if not axes:
        raise ConfigError("--sweep: no values to sweep")
    return axes


def combinations(axes: list[tuple[str, list[str]]]) -> int:
    """How many tasks the axes make: checked against the cluster before a config is built for
    each."""
    return math.prod(len(values) for _, values in axes)


def expand(cfg: RunConfig, axes: list[tuple[str, list[str]]]) -> Sweep:
    """Every combination, built and validated as a full config."""
    keys = [key for key, _ in axes]
    short = [key.rpartition(".")[2] for key in keys]
    labels = short if len(set(short)) == len(short) else keys
    values, configs = [], []
    for combination in itertools.product(*(vals for _, vals in axes)):
        sets = [f"{key}={value}" for key, value in zip(keys, combination)]
        label = "-".join(f"{name}_{_slug(value)}" for name, value in zip(labels, combination))
        try:
            task = with_overrides(cfg, [*sets, f"train.run_name={cfg.train.run_name}-{label}"])
        except ConfigError as exc:
            raise ConfigError(f"--sweep {' '.join(sets)}: {exc}") from None
        values.append(dict(zip(keys, combination)))
        configs.append(task)
    names = [c.train.run_name for c in configs]
    if len(set(names)) != len(names):
        raise ConfigError(
            f"--sweep: two combinations give the same run name ({names}); sweep distinct values"
        )
    return Sweep(cfg.train.run_name, keys, values, configs)


def folder(planned: Sweep) -> Path:
    return Path(planned.configs[0].logging.runs_dir).resolve() / ".sweeps" / planned.name


def write(sweep: Sweep, where: Path) -> None:
    """Each task's config (task-<i>.yaml, which the job array's task i trains with) and
    sweep.json."""
    rundir.create(where, sweep.configs[0].logging.shared)  # as a run directory is made
    for index, cfg in enumerate(sweep.configs):
        write_atomic(where / f"task-{index}.yaml", dump_yaml(cfg))
    runs = [
        {"task": i, "run_name": c.train.run_name, "values": v}
        for i, (c, v) in enumerate(zip(sweep.configs, sweep.values))
    ]
    write_atomic(
        where / FILE, json.dumps({"name": sweep.name, "keys": sweep.keys, "runs": runs}, indent=1)
    )


def array_spec(tasks: int, max_parallel: int | None) -> str:
    if max_parallel is not None and max_parallel < 1:
        raise ConfigError(f"--max-parallel: {max_parallel} is below 1")
    return f"0-{tasks - 1}" + (f"%{max_parallel}" if max_parallel else "")


def check_size(tasks: int, run: Runner = subprocess.run) -> None:
    """Refuse more tasks than the cluster's MaxArraySize allows (array indices go up to it,
    exclusive)."""
    limit = max_array_size(run)
    if tasks > limit:
        raise QgtrainError(
            f"--sweep: {tasks} combinations, but this cluster's MaxArraySize allows {limit} tasks "
            "in one array; sweep fewer values, or split the sweep"
        )


def max_array_size(run: Runner = subprocess.run) -> int:
    try:
        shown = run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return DEFAULT_MAX_ARRAY_SIZE
    match = re.search(r"^MaxArraySize\s*=\s*(\d+)", shown.stdout or "", re.MULTILINE)
    return int(match.group(1)) if match else DEFAULT_MAX_ARRAY_SIZE


def from_snapshot(planned: Sweep, where: Path, dry_run: bool = False) -> tuple[Sweep, Code | None]:
    """The tasks' configs as they run from one code snapshot in the sweep's folder
    (slurm.snapshot), taken now (or, for a dry run, only planned: its size checked, nothing
    copied). The folder is refused first if others could write it (rundir.require_safe)."""
    from .runfrom import job_config, snapshot
    from .runfrom import planned as planned_code

    first = planned.configs[0]
    if not dry_run:  # the sweep's folder holds the job files, as a run directory does
        rundir.require_safe(where)
    if not runs_from_snapshot(first.slurm):
        return planned, None
    take = planned_code if dry_run else snapshot
    code = take(first, Path.cwd(), where / "code")
    moved = (
        planned.configs
        if dry_run
        else [job_config(cfg, Path.cwd(), code) for cfg in planned.configs]
    )
    return dataclasses.replace(planned, configs=moved), code


def submit_array(planned: Sweep, max_parallel: int | None, *, dry_run: bool, launcher: str) -> str:
    """sbatch the job array (or, with dry_run, show its script and tasks); returns what to print."""
    from .runfrom import shell_lines
    from .sbatch import render, submit
    from .submit_host import submitting_python

    tasks = len(planned.configs)
    array, where = array_spec(tasks, max_parallel), folder(planned)
    planned, code = from_snapshot(planned, where, dry_run)
    lines = shell_lines(code) if code else None
    first, python = planned.configs[0], submitting_python()
    listing = "".join(
        f"# task {i}: {c.train.run_name}: " + " ".join(f"{k}={v}" for k, v in values.items()) + "\n"
        for i, (c, values) in enumerate(zip(planned.configs, planned.values))
    )
    if dry_run:
        return (
            render(first.slurm, str(where), array=array, code=lines, python=python)
            if launcher == "sbatch"
            else f"# array {array}\n"
        ) + listing
    write(planned, where)
    Path(first.slurm.output_dir).mkdir(parents=True, exist_ok=True)
    script = render(first.slurm, str(where), array=array, code=lines, python=python)
    write_atomic(where / "job.sbatch", script)
    job_id = submit(where / "job.sbatch")
    return (
        f"submitted job array {job_id} with {tasks} tasks ({array}); configs in {where}; runs in "
        f"{Path(first.logging.runs_dir).resolve()}\n"
    )


def swept_values(runs_dir: Path) -> dict[str, dict[str, str]]:
    """Run name -> its swept values, for every sweep under runs_dir (for `qgtrain runs`)."""
    found: dict[str, dict[str, str]] = {}
    for path in sorted((runs_dir / ".sweeps").glob(f"*/{FILE}")):
        try:
            for run in json.loads(path.read_text())["runs"]:
                found[str(run["run_name"])] = {str(k): str(v) for k, v in run["values"].items()}
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def _slug(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", value).strip("_") or "_"
