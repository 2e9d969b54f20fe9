"""`qgtrain.submit(...)`: a training run as a submitit job that comes back by itself after
preemptions.

The task is Checkpointable, but its checkpoint() saves nothing: when Slurm's warning signal arrives,
the trainer's own handlers make every rank stop at the same step and save one checkpoint; then rank
0 hands over to submitit's handler, which calls checkpoint() (a fresh task on the same run
directory, which resumes from that checkpoint) and requeues. Waiting never hangs: job state falls
back to squeue and scontrol where sacct has no accounting behind it, and every wait can take a
deadline.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import submitit
from submitit.slurm.slurm import SlurmJob

from ..config import RunConfig
from ..config.load import config_files, config_to_dict, load_config, with_overrides
from ..config.slurm import runs_from_snapshot
from ..foundation.errors import EXIT_STOPPED, QgtrainError
from ..foundation.files import owner_writes_only
from ..runs.rundir import RunDir, create, default_run_dir, require_safe
from ..runtime.slurm import (
    is_time_limit,
    job_state,
    reason_not_to_requeue,
    seconds_left,
)
from . import submitit_compat, sweep
from .runfrom import job_config, snapshot
from .slurm_checks import time_minutes
from .submit_host import require_slurm
from .submitit_params import container_python, executor_parameters, recover_arguments
from .sweep import Sweep


class TrainTask(submitit.helpers.Checkpointable):
    """`qgtrain train` on every task of the job, with the run directory fixed at submission."""

    def __init__(self, config: dict[str, Any], run_dir: str) -> None:
        self.config, self.run_dir = config, run_dir

    @owner_writes_only()
    def __call__(self) -> dict[str, Any]:
        from ..config.load import config_from_dict
        from ..run import train
        from ..runtime.rendezvous import from_environ

        env = from_environ(os.environ)
        cfg = config_from_dict(self.config, "submitted config")
        code = train(cfg, env, self.run_dir, requeue_on_stop=False)
        if code == EXIT_STOPPED:
            _requeue_through_submitit(
                env.rank,
                str(env.job_id),
                env.restart_count,
                60.0 * time_minutes(cfg.slurm.time),
                cfg.slurm.signal_lead_s,
            )
        return {"run_dir": self.run_dir, "exit_code": code}

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """The trainer has already saved at the agreed step; the next allocation resumes from it."""
        return submitit.helpers.DelayedSubmission(TrainTask(self.config, self.run_dir))


def _requeue_through_submitit(
    rank: int, job_id: str, restart: int, limit_s: float, lead_s: float
) -> None:
    """Rank 0 runs submitit's own handler for its preemption signal (restored when training ended),
    which pickles checkpoint() and requeues the job; the other ranks just leave, writing no result.
    A cancelled job (scancel sends SIGTERM too) is not requeued. Whether the stop was the time limit
    or a preemption is decided here (is_time_limit), so that preemptions never use up submitit's
    timeout budget."""
    signum = submitit_compat.preemption_signal()
    handler = signal.getsignal(signum)
    if rank == 0:
        reason = reason_not_to_requeue(job_state(job_id), restart)
        left_s = seconds_left(job_id)
        submitit_compat.decide_timed_out(
            handler, lambda ran_s: is_time_limit(left_s, ran_s, limit_s, lead_s)
        )
        if reason is None and callable(handler):
            print(
                "qgtrain: stopped at a checkpoint; requeueing through submitit",
                file=sys.stderr,
                flush=True,
            )
            handler(signum, None)
        print(
            "qgtrain: stopped at a checkpoint; not requeued: "
            f"{reason or 'no submitit handler is installed'}",
            file=sys.stderr,
            flush=True,
        )
    raise SystemExit(EXIT_STOPPED)


def _from_squeue(ids: list[str]) -> dict[str, dict[str, str]]:
    info: dict[str, dict[str, str]] = {}
    try:
        out = subprocess.run(
            ["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%N"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        for line in out.stdout.splitlines():
            job_id, state, nodes = (line.split("|") + ["", ""])[:3]
            info[job_id.strip()] = {
                "JobID": job_id.strip(),
                "State": state.strip(),
                "NodeList": nodes.strip(),
            }
        for job_id in set(ids) - set(info):
            shown = subprocess.run(
                ["scontrol", "show", "job", "-o", job_id],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
            for field in shown.split():
                if field.startswith("JobState="):
                    info[job_id] = {"JobID": job_id, "State": field.split("=", 1)[1]}
    except (OSError, subprocess.TimeoutExpired):
        pass
    return info


class SqueueFallbackWatcher(submitit_compat.FallbackWatcher):
    fallback = staticmethod(_from_squeue)


class TrainJob(SlurmJob[Any]):
    """A submitit Slurm job whose waits end: by state from squeue/scontrol, or by a deadline."""

    watcher = SqueueFallbackWatcher(delay_s=60)

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} is still {self.state} after {timeout:.0f}s")
            time.sleep(1)

    def result(self, timeout: float | None = None) -> Any:
        """Rank 0's result (every rank returns the same); raises if the job failed or was
        cancelled."""
        self.wait(timeout)
        if tasks := submitit_compat.task_jobs(self):  # one per task (rank) in a multi-task job
            return tasks[0].result()
        return super().result()


@owner_writes_only()
def submit(
    config: RunConfig | str | Path | None = None,
    *,
    run_dir: str | Path | None = None,
    folder: str | Path | None = None,
    **overrides: Any,
) -> TrainJob:
    """Submit training as a submitit job; returns it (`.result(timeout)`, `.state`, `.cancel()`).

    `config` is a RunConfig, a config file, or None for ./config.yaml (or the defaults). Overrides
    are config keys with `__` for the dot: `submit("config.yaml", train__max_steps=1000,
    slurm__nodes=2)`.
    """
    if isinstance(config, RunConfig):
        cfg = with_overrides(config, _sets(overrides)) if overrides else config
    else:
        cfg = load_config(config_files(config), _sets(overrides))
    require_slurm("sbatch", "srun")  # submitit's Slurm executor runs both; nothing written yet
    target = Path(run_dir or default_run_dir(cfg)).resolve()
    require_safe(target)  # before the snapshot: nothing is written into a foreign run
    code = snapshot(cfg, Path.cwd(), RunDir(target).code) if runs_from_snapshot(cfg.slurm) else None
    cfg = job_config(cfg, Path.cwd(), code) if code else cfg
    executor = submitit.AutoExecutor(
        folder=Path(folder or target / "submitit"),
        slurm_max_num_timeout=cfg.slurm.max_restarts,
        slurm_python=container_python(cfg),
    )
    if executor.cluster != "slurm":
        raise QgtrainError(
            "submit: no Slurm found here (srun is not on PATH); run this on a Slurm login node, "
            "or train directly with `qgtrain train`"
        )
    recover_args = recover_arguments(cfg, target)
    executor.update_parameters(**executor_parameters(cfg, recover_args=recover_args, code=code))
    submitit_compat.use_job_class(executor, TrainJob)
    # submitit's folder inside the run directory would create it with the umask's mode
    if folder is None:
        create(target, cfg.logging.shared)
    return cast(TrainJob, executor.submit(TrainTask(config_to_dict(cfg), str(target))))


@owner_writes_only()
def submit_sweep(
    config: RunConfig | str | Path | None,
    values: Mapping[str, Sequence[Any]] | Sweep,
    *,
    max_parallel: int | None = None,
) -> list[TrainJob]:
    """Submit one job array, a task (and a run) per combination of `values`, e.g.
    `submit_sweep("config.yaml", {"optim.lr": [1e-3, 3e-4], "train.seed": [1, 2]}, max_parallel=2)`.
    Every combination is checked before anything is submitted; each task is requeued on its own."""
    if isinstance(values, Sweep):
        planned = values
    else:
        base = config if isinstance(config, RunConfig) else load_config(config_files(config))
        axes = sweep.parse([f"{k}={','.join(map(_text, v))}" for k, v in values.items()])
        sweep.check_size(sweep.combinations(axes))
        planned = sweep.expand(base, axes)
    # a Sweep given (by the CLI) was checked by its maker
    sweep.array_spec(len(planned.configs), max_parallel)
    require_slurm("sbatch", "srun")
    where = sweep.folder(planned)
    planned, code = sweep.from_snapshot(planned, where)
    first = planned.configs[0]
    sweep.write(planned, where)
    executor = submitit.AutoExecutor(
        folder=where / "submitit",
        slurm_max_num_timeout=first.slurm.max_restarts,
        slurm_python=container_python(first),
    )
    if executor.cluster != "slurm":
        raise QgtrainError(
            "submit_sweep: no Slurm found here (srun is not on PATH); run this on a Slurm login "
            "node"
        )
    # its run, its settings
    each_task = f'--config {shlex.quote(str(where))}"/task-${{SLURM_ARRAY_TASK_ID}}.yaml"'
    executor.update_parameters(
        **executor_parameters(first, recover_args=each_task, code=code),
        slurm_array_parallelism=max_parallel or len(planned.configs),
    )
    submitit_compat.use_job_class(executor, TrainJob)
    with executor.batch():
        jobs = [
            executor.submit(TrainTask(config_to_dict(cfg), str(default_run_dir(cfg).resolve())))
            for cfg in planned.configs
        ]
    # submitit makes an array's jobs plain SlurmJobs: the same jobs, seen through our watcher and
    # deadlines
    return [
        TrainJob(folder=executor.folder, job_id=job.job_id, tasks=list(range(job.num_tasks)))
        for job in jobs
    ]


def _sets(overrides: dict[str, Any]) -> list[str]:
    return [f"{key.replace('__', '.')}={_text(value)}" for key, value in overrides.items()]


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(repr(str(v)) for v in value) + "]"
    return "null" if value is None else str(value)
