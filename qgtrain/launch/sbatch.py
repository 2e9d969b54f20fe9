"""The batch script: rendered from the config's `slurm:` section, submitted with sbatch. No torch
here.

train.slurm is this renderer's output for the default config (a test keeps them identical). The
script computes no rank, address or port: srun starts one task per GPU and rendezvous.py reads
SLURM_*. Every config value that reaches the script is checked against what Slurm accepts and
quoted, so no value can run a command; slurm.setup is the one field that is shell code by design.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import RunConfig, SlurmConfig
from ..config.slurm import ranks_per_node, runs_from_snapshot
from ..foundation.errors import QgtrainError
from ..foundation.files import owner_writes_only, write_atomic
from .slurm_checks import validate
from .steps import retry_steps, shapes_steps
from .submit_host import snapshot_first, submitting_python

if TYPE_CHECKING:
    from .codesnap import Code

Runner = Callable[..., "subprocess.CompletedProcess[str]"]

SUBMITTED_PYTHON = "PYTHON=${{QGTRAIN_PYTHON:-{python}}}  # the interpreter that submitted the job"
HOST_PYTHON = """PYTHON=${QGTRAIN_PYTHON:-python3}
if [ -z "${QGTRAIN_PYTHON:-}" ] && [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; fi"""
IMAGE_PYTHON = """PYTHON=${QGTRAIN_PYTHON:-python}  # inside the image, which must hold qgtrain
HOST_PYTHON=${QGTRAIN_HOST_PYTHON:-python3}  # here, for `qgtrain recover` after a failed step
if [ -z "${QGTRAIN_HOST_PYTHON:-}" ] && [ -x .venv/bin/python ]; then HOST_PYTHON=$PWD/.venv/bin/python; fi"""  # noqa: E501 (lines of the rendered train.slurm, which stays byte-identical)
FIRST_START_SNAPSHOT = (
    """job_id=${SLURM_ARRAY_JOB_ID:-${SLURM_JOB_ID:-}}
job_id=$job_id${SLURM_ARRAY_TASK_ID:+_$SLURM_ARRAY_TASK_ID}
# every attempt, requeues too, runs the code as it was at the job's first start (slurm.snapshot)
code=$("$RECOVER_PYTHON" -m qgtrain snapshot "${args[@]}" --job "$job_id") || {
    [ "$?" = 2 ] && exit 2
    echo "qgtrain: no code snapshot (qgtrain snapshot failed); running the code on disk" >&2
    code=; }
if [ -n "$code" ]; then
    { read -r workdir; read -r pythonpath; read -r config; } <<< "$code"
"""
    + snapshot_first('"$RECOVER_PYTHON"', '"$workdir"', "    ")
    + """    export PYTHONPATH="$pythonpath${PYTHONPATH:+:$PYTHONPATH}"
    args=(--config "$config")
fi
"""
)


class SubmissionError(QgtrainError):
    """sbatch refused the job; carries what it said."""


def launch_lines(slurm: SlurmConfig, python: str | None = None) -> tuple[str, str, str]:
    """How the script finds Python, what goes between srun's options and Python (pyxis' options, or
    the apptainer command), and the variable naming the batch shell's own Python (for `qgtrain
    recover`): the ranks run on the host, in a pyxis container or under apptainer, in the working
    directory either way. On the host, `python` (the submitting interpreter) is the default unless
    QGTRAIN_PYTHON names another; without it (train.slurm) the job looks for one at its start."""
    mounts = ",".join(slurm.container_mounts)
    if slurm.container_image:
        return (
            IMAGE_PYTHON,
            (
                f"--container-image={shlex.quote(slurm.container_image)} "
                f'--container-mounts="$PWD:$PWD{"," + mounts if mounts else ""}" \\\n'
                '        --container-workdir="$PWD" '
            ),
            "HOST_PYTHON",
        )
    if slurm.apptainer_image:
        return (
            IMAGE_PYTHON,
            (
                f'apptainer exec{" --nv" if slurm.gpus_per_node else ""} --pwd "$PWD"'
                f"{' --bind ' + mounts if mounts else ''} {shlex.quote(slurm.apptainer_image)} "
                "\\\n        "
            ),
            "HOST_PYTHON",
        )
    if python is not None:
        return SUBMITTED_PYTHON.format(python=shlex.quote(python)), "", "PYTHON"
    return HOST_PYTHON, "", "PYTHON"


def render(
    slurm: SlurmConfig,
    config_path: str,
    array: str | None = None,
    code: str | None = None,
    after: str = "",
    command: str = "train",
    python: str | None = None,
) -> str:
    """The batch script for `slurm`, training with `config_path` unless CONFIG or $1 names another.
    With `array` (e.g. '0-3%2') it is a job array whose task i trains with
    `config_path`/task-<i>.yaml. `code`: the lines that move the job into its code snapshot
    (runfrom.shell_lines), taken at submit; without them, with slurm.snapshot, the script takes one
    at its first start. `after`: lines run once the training steps are over, with their exit code in
    $status (the next stage of a chain). `command`: what each step runs, `qgtrain train` or (a
    chain's evaluation stage) `qgtrain eval RUN --all`, shell-quoted by the caller. `python`: the
    interpreter the job runs by default (submit's own, submit_host.submitting_python); None for
    train.slurm, which finds one where it runs."""
    validate(slurm)
    header = "\n".join(f"#SBATCH {option}" for option in _options(slurm, array))
    setup = "".join(f"{line}\n" for line in slurm.setup)
    default = shlex.quote(config_path) + ('/task-"${SLURM_ARRAY_TASK_ID}".yaml' if array else "")
    first_start = FIRST_START_SNAPSHOT if runs_from_snapshot(slurm) else ""
    moves = code if code is not None else first_start
    launch = launch_lines(slurm, python)
    return _script(header, setup, default, slurm, launch, moves, after, command)


def _options(slurm: SlurmConfig, array: str | None) -> list[str]:
    options = [
        f"--job-name={slurm.job_name}",
        f"--nodes={slurm.nodes + slurm.spare_nodes}",
        f"--ntasks-per-node={ranks_per_node(slurm)}",
        f"--cpus-per-task={slurm.cpus_per_task}",
    ]
    if slurm.gpus_per_node:
        options.append(f"--gpus-per-node={slurm.gpus_per_node}")
    options += [
        f"--{key}={getattr(slurm, key)}"
        for key in ("mem", "partition", "account", "qos", "constraint")
        if getattr(slurm, key)
    ]
    options += [
        f"--time={slurm.time}",
        "--requeue" if slurm.requeue else "--no-requeue",
        # a node that fails must not end the allocation the next step runs in
        *(["--no-kill"] if shapes_steps(slurm) else []),
        f"--signal={slurm.signal}@{slurm.signal_lead_s}",
        "--open-mode=append",
        f"--output={slurm.output_dir}/%x-{'%A_%a' if array else '%j'}.out",
        *slurm.extra_sbatch,
    ]
    if array is not None:
        if not re.fullmatch(r"\d+-\d+(%\d+)?", array):
            raise QgtrainError(f"--array {array!r}: expected FIRST-LAST[%PARALLEL]")
        options.append(f"--array={array}")
    return options


def _script(
    header: str,
    setup: str,
    default: str,
    slurm: SlurmConfig,
    launch: tuple[str, str, str],
    code: str,
    after: str,
    command: str = "train",
) -> str:
    """The script's text: no rank, address or port logic; srun steps until the run is done or
    requeued. `launch`: launch_lines(), for the host, a pyxis container or apptainer."""
    python, srun, recover = launch
    steps = retry_steps(slurm)
    return f"""#!/bin/bash
# qgtrain batch job: one task (rank) per GPU on every node, all started by srun.
#   sbatch train.slurm                              train with config.yaml
#   sbatch train.slurm config.yaml jobs/cpu.yaml    later files overlay earlier ones
#   CONFIG=my.yaml sbatch train.slurm               one file named in the environment
# On the warning signal (--signal) every rank stops at the same step, saves one checkpoint, and rank 0
# requeues the job; the requeued job resumes from that checkpoint. Rendered by `qgtrain submit` from the
# config's slurm: section; edit the config rather than this header.
{header}

set -u
QGTRAIN_BATCH_START=$(date +%s); export QGTRAIN_BATCH_START  # where the run's time begins
{setup}default_config={default}
if [ "$#" -gt 0 ]; then configs=("$@"); else configs=("${{CONFIG:-$default_config}}"); fi
args=()
for file in "${{configs[@]}}"; do args+=(--config "$file"); done
{python}

RECOVER_PYTHON=${recover}
{code}recover_args=("${{args[@]}}")
{steps}
run_steps --kill-on-bad-exit=1 {srun}"$PYTHON" -m qgtrain {command} "${{args[@]}}"
{f'status=$?{chr(10)}{after}exit "$status"' if after else 'exit "$?"'}
"""  # noqa: E501 (lines of the rendered train.slurm, which stays byte-identical)


@owner_writes_only()  # the snapshot and job files, whoever calls: none group-writable
def submit_config(
    cfg: RunConfig,
    job_dir: Path,
    run: Runner = subprocess.run,
    after: str = "",
    code: Code | None = None,
) -> str:
    """Write the job's config and script into `job_dir` (kept for the requeued job) and submit it,
    to run from a snapshot of the working directory's code (`code`, or one taken now) unless
    slurm.snapshot is off."""
    from ..config.load import dump_yaml
    from ..runs.rundir import RunDir, create, folder_mode, require_safe
    from .nodes import check_exclusions
    from .runfrom import job_config, shell_lines, snapshot

    require_safe(job_dir.parent)  # before the snapshot: nothing is written into a foreign run
    check_exclusions(cfg.slurm, run)
    if runs_from_snapshot(cfg.slurm):
        code = code or snapshot(cfg, Path.cwd(), RunDir(job_dir.parent).code)
        cfg = job_config(cfg, Path.cwd(), code)
    moves = shell_lines(code) if code else None
    script = render(
        cfg.slurm, str(job_dir / "config.yaml"), code=moves, after=after, python=submitting_python()
    )
    create(job_dir.parent, cfg.logging.shared)  # the run directory, private unless logging.shared
    job_dir.mkdir(mode=folder_mode(cfg.logging.shared), exist_ok=True)
    Path(cfg.slurm.output_dir).mkdir(parents=True, exist_ok=True)
    # replaced, never written through: a link planted at either name is swapped, not followed
    write_atomic(job_dir / "config.yaml", dump_yaml(cfg))
    write_atomic(job_dir / "job.sbatch", script)
    return submit(job_dir / "job.sbatch", run)


def submit(script: Path, run: Runner = subprocess.run) -> str:
    """sbatch the script; returns the job id."""
    try:
        result = run(
            ["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120
        )
    except FileNotFoundError:
        raise SubmissionError(
            "sbatch is not on PATH: run `qgtrain submit` on a Slurm login node, or use "
            "`qgtrain submit --dry-run` to see the script"
        ) from None
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip()
        raise SubmissionError(f"sbatch refused {script} (exit {result.returncode}): {said}")
    return parse_job_id(result.stdout)


def parse_job_id(stdout: str) -> str:
    """`--parsable` prints '<id>' or '<id>;<cluster>'; older output says 'Submitted batch job
    <id>'."""
    match = re.search(r"(?:^|Submitted batch job )(\d+)(?:;\S+)?\s*$", stdout.strip(), re.MULTILINE)
    if not match:
        raise SubmissionError(f"cannot find a job id in sbatch's output: {stdout.strip()!r}")
    return match.group(1)
