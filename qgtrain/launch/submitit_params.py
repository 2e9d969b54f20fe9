"""A run's config as submitit's AutoExecutor parameters: the same resources, container, code
snapshot and step retries as train.slurm gives its job, and what `--dry-run` shows of them. No torch
and no submitit here: the parameters are a plain dict.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..config.slurm import ranks_per_node, runs_from_snapshot
from ..runs.rundir import RunDir, default_run_dir
from .codesnap import Code
from .runfrom import shell_lines
from .slurm_checks import time_minutes, validate
from .steps import retry_steps, shapes_steps


def container_python(cfg: RunConfig, workdir: str | None = None) -> str | None:
    """The command submitit starts each task's Python with: the image's own in a container, None
    (the submitting interpreter) on the host. Apptainer wraps it; pyxis takes srun options
    instead."""
    s, workdir = cfg.slurm, workdir or str(Path.cwd())
    if s.apptainer_image:
        bind = ["--bind", ",".join(s.container_mounts)] if s.container_mounts else []
        return shlex.join(
            [
                "apptainer",
                "exec",
                *(["--nv"] if s.gpus_per_node else []),
                "--pwd",
                workdir,
                *bind,
                s.apptainer_image,
                "python",
            ]
        )
    return "python" if s.container_image else None


def dry_run_parameters(cfg: RunConfig) -> dict[str, Any]:
    """What `qgtrain submit --launcher submitit --dry-run` shows: the parameters, and Python's
    command."""
    from .runfrom import planned

    python, target = container_python(cfg), default_run_dir(cfg).resolve()
    code = planned(cfg, Path.cwd(), RunDir(target).code) if runs_from_snapshot(cfg.slurm) else None
    return {
        **executor_parameters(cfg, recover_args=recover_arguments(cfg, target), code=code),
        **({"slurm_python": python} if python else {}),
    }


def executor_parameters(
    cfg: RunConfig,
    workdir: str | None = None,
    recover_args: str | None = None,
    code: Code | None = None,
) -> dict[str, Any]:
    """The config's slurm: section as AutoExecutor parameters (the same resources and container as
    train.slurm, with the working directory spelled out: submitit quotes what it is given). With
    `recover_args` (what tells `qgtrain recover` the run, as shell words), a failed step is brought
    back as train.slurm does it: submitit's `srun` line calls a shell function that runs the real
    srun in the same retry loop."""
    s, workdir = cfg.slurm, workdir or str(Path.cwd())
    validate(s)
    params: dict[str, Any] = {
        "name": s.job_name,
        "nodes": s.nodes + s.spare_nodes,
        "tasks_per_node": ranks_per_node(s),
        "cpus_per_task": s.cpus_per_task,
        "timeout_min": time_minutes(s.time),
        "slurm_signal_delay_s": s.signal_lead_s,
        # a rank that dies takes the step down at once, as in train.slurm
        "slurm_srun_args": ["--kill-on-bad-exit=1"],
    }
    if s.gpus_per_node:
        params["gpus_per_node"] = s.gpus_per_node
    if s.mem:
        params["slurm_mem"] = s.mem
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(s, key):
            params[f"slurm_{key}"] = getattr(s, key)
    extra: dict[str, Any] = {"requeue": True} if s.requeue else {"no_requeue": True}
    if shapes_steps(s):  # a node that fails must not end the allocation the next step runs in
        extra["no_kill"] = True
    for option in s.extra_sbatch:
        name, _, value = option[2:].partition("=")
        extra[name.replace("-", "_")] = value or True
    params["slurm_additional_parameters"] = extra
    if s.container_image:
        params["slurm_srun_args"] += [
            f"--container-image={s.container_image}",
            "--container-mounts=" + ",".join([f"{workdir}:{workdir}", *s.container_mounts]),
            f"--container-workdir={workdir}",
        ]
    # the job's submitit handler must listen for the same signal as our trainer
    params["slurm_setup"] = [*s.setup, f"export SUBMITIT_PREEMPT_SIGNAL={s.signal}"]
    if code is not None:  # every attempt runs the code as submitted, as train.slurm's jobs do
        params["slurm_setup"] += shell_lines(code).splitlines()
    if recover_args is not None:
        params["slurm_setup"] += [
            f"RECOVER_PYTHON={shlex.quote(sys.executable)}",
            f"recover_args=({recover_args})",
            retry_steps(s),
            'srun() { run_steps "$@"; }',
        ]
    return params


def recover_arguments(cfg: RunConfig, run_dir: Path) -> str:
    """`qgtrain recover`'s view of a submitit job: its run directory and the retry settings (it has
    no file)."""
    s = cfg.slurm
    return shlex.join(
        [
            "--run-dir",
            str(run_dir),
            "--set",
            f"slurm.step_retries={s.step_retries}",
            f"slurm.max_restarts={s.max_restarts}",
            f"slurm.requeue={str(s.requeue).lower()}",
            f"slurm.nodes={s.nodes}",
            f"slurm.min_nodes={s.min_nodes}",
            f"train.grad_accum_steps={cfg.train.grad_accum_steps}",
            f"slurm.partition={s.partition}",
        ]
    )
