"""`qgtrain.submit(...)`: a training run as a submitit job that comes back by itself after preemptions.

The task is Checkpointable, but its checkpoint() saves nothing: when Slurm's warning signal arrives, the
trainer's own handlers make every rank stop at the same step and save one checkpoint; then rank 0 hands
over to submitit's handler, which calls checkpoint() (a fresh task on the same run directory, which
resumes from that checkpoint) and requeues. Waiting never hangs: job state falls back to squeue and
scontrol where sacct has no accounting behind it, and every wait can take a deadline.
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
from ..configload import config_files, config_to_dict, load_config, with_overrides
from ..errors import EXIT_STOPPED, QgtrainError
from ..runtime.slurm import (
    is_time_limit,
    job_state,
    reason_not_to_requeue,
    seconds_left,
)
from ..state.rundir import RunDir, create, default_run_dir
from . import submitit_compat, sweep
from .codesnap import Code
from .runfrom import job_config, shell_lines, snapshot
from .sbatch import retry_steps, snapshots, tasks_per_node, time_minutes, validate
from .sweep import Sweep


class TrainTask(submitit.helpers.Checkpointable):
    """`qgtrain train` on every task of the job, with the run directory fixed at submission."""

    def __init__(self, config: dict[str, Any], run_dir: str) -> None:
        self.config, self.run_dir = config, run_dir

    def __call__(self) -> dict[str, Any]:
        from ..configload import config_from_dict
        from ..run import train
        from ..runtime.rendezvous import from_environ

        env = from_environ(os.environ)
        cfg = config_from_dict(self.config, "submitted config")
        code = train(cfg, env, self.run_dir, requeue_on_stop=False)
        if code == EXIT_STOPPED:
            _requeue_through_submitit(env.rank, str(env.job_id), env.restart_count, 60.0 * time_minutes(cfg.slurm.time),
                                      cfg.slurm.signal_lead_s)
        return {"run_dir": self.run_dir, "exit_code": code}

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """The trainer has already saved at the agreed step; the next allocation resumes from it."""
        return submitit.helpers.DelayedSubmission(TrainTask(self.config, self.run_dir))


def _requeue_through_submitit(rank: int, job_id: str, restart: int, limit_s: float, lead_s: float) -> None:
    """Rank 0 runs submitit's own handler for its preemption signal (restored when training ended), which
    pickles checkpoint() and requeues the job; the other ranks just leave, writing no result. A cancelled
    job (scancel sends SIGTERM too) is not requeued. Whether the stop was the time limit or a preemption
    is decided here (is_time_limit), so that preemptions never use up submitit's timeout budget."""
    signum = submitit_compat.preemption_signal()
    handler = signal.getsignal(signum)
    if rank == 0:
        reason = reason_not_to_requeue(job_state(job_id), restart)
        left_s = seconds_left(job_id)
        submitit_compat.decide_timed_out(handler, lambda ran_s: is_time_limit(left_s, ran_s, limit_s, lead_s))
        if reason is None and callable(handler):
            print("qgtrain: stopped at a checkpoint; requeueing through submitit", file=sys.stderr, flush=True)
            handler(signum, None)
        print(f"qgtrain: stopped at a checkpoint; not requeued: {reason or 'no submitit handler is installed'}",
              file=sys.stderr, flush=True)
    raise SystemExit(EXIT_STOPPED)


def _from_squeue(ids: list[str]) -> dict[str, dict[str, str]]:
    info: dict[str, dict[str, str]] = {}
    try:
        out = subprocess.run(["squeue", "-h", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%N"],
                             capture_output=True, text=True, timeout=60)
        for line in out.stdout.splitlines():
            job_id, state, nodes = (line.split("|") + ["", ""])[:3]
            info[job_id.strip()] = {"JobID": job_id.strip(), "State": state.strip(), "NodeList": nodes.strip()}
        for job_id in set(ids) - set(info):
            shown = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                                   timeout=60).stdout
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
        """Rank 0's result (every rank returns the same); raises if the job failed or was cancelled."""
        self.wait(timeout)
        if tasks := submitit_compat.task_jobs(self):  # one per task (rank) in a multi-task job
            return tasks[0].result()
        return super().result()


def container_python(cfg: RunConfig, workdir: str | None = None) -> str | None:
    """The command submitit starts each task's Python with: the image's own in a container, None (the
    submitting interpreter) on the host. Apptainer wraps it; pyxis takes srun options instead."""
    s, workdir = cfg.slurm, workdir or str(Path.cwd())
    if s.apptainer_image:
        bind = ["--bind", ",".join(s.container_mounts)] if s.container_mounts else []
        return shlex.join(["apptainer", "exec", *(["--nv"] if s.gpus_per_node else []), "--pwd", workdir, *bind,
                           s.apptainer_image, "python"])
    return "python" if s.container_image else None


def dry_run_parameters(cfg: RunConfig) -> dict[str, Any]:
    """What `qgtrain submit --launcher submitit --dry-run` shows: the parameters, and Python's command."""
    from .runfrom import planned

    python, target = container_python(cfg), default_run_dir(cfg).resolve()
    code = planned(cfg, Path.cwd(), RunDir(target).code) if snapshots(cfg.slurm) else None
    return {**executor_parameters(cfg, recover_args=_recover_args(cfg, target), code=code),
            **({"slurm_python": python} if python else {})}


def executor_parameters(cfg: RunConfig, workdir: str | None = None,
                        recover_args: str | None = None,
                        code: Code | None = None) -> dict[str, Any]:
    """The config's slurm: section as AutoExecutor parameters (the same resources and container as
    train.slurm, with the working directory spelled out: submitit quotes what it is given). With
    `recover_args` (what tells `qgtrain recover` the run, as shell words), a failed step is brought back
    as train.slurm does it: submitit's `srun` line calls a shell function that runs the real srun in the
    same retry loop."""
    s, workdir = cfg.slurm, workdir or str(Path.cwd())
    validate(s)
    params: dict[str, Any] = {"name": s.job_name, "nodes": s.nodes, "tasks_per_node": tasks_per_node(s),
                              "cpus_per_task": s.cpus_per_task, "timeout_min": time_minutes(s.time),
                              "slurm_signal_delay_s": s.signal_lead_s,
                              # a rank that dies takes the step down at once, as in train.slurm
                              "slurm_srun_args": ["--kill-on-bad-exit=1"]}
    if s.gpus_per_node:
        params["gpus_per_node"] = s.gpus_per_node
    if s.mem:
        params["slurm_mem"] = s.mem
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(s, key):
            params[f"slurm_{key}"] = getattr(s, key)
    extra: dict[str, Any] = {"requeue": True} if s.requeue else {"no_requeue": True}
    for option in s.extra_sbatch:
        name, _, value = option[2:].partition("=")
        extra[name.replace("-", "_")] = value or True
    params["slurm_additional_parameters"] = extra
    if s.container_image:
        params["slurm_srun_args"] += [f"--container-image={s.container_image}", "--container-mounts=" + ",".join(
            [f"{workdir}:{workdir}", *s.container_mounts]), f"--container-workdir={workdir}"]
    # the job's submitit handler must listen for the same signal as our trainer
    params["slurm_setup"] = [*s.setup, f"export SUBMITIT_PREEMPT_SIGNAL={s.signal}"]
    if code is not None:  # every attempt runs the code as submitted, as train.slurm's jobs do
        params["slurm_setup"] += shell_lines(code).splitlines()
    if recover_args is not None:
        params["slurm_setup"] += [f"RECOVER_PYTHON={shlex.quote(sys.executable)}", f"recover_args=({recover_args})",
                                  retry_steps(s.max_restarts), 'srun() { run_steps command srun "$@"; }']
    return params


def _recover_args(cfg: RunConfig, run_dir: Path) -> str:
    """`qgtrain recover`'s view of a submitit job: its run directory and the retry settings (it has no file)."""
    s = cfg.slurm
    return shlex.join(["--run-dir", str(run_dir), "--set", f"slurm.step_retries={s.step_retries}",
                       f"slurm.max_restarts={s.max_restarts}", f"slurm.requeue={str(s.requeue).lower()}",
                       f"slurm.nodes={s.nodes}", f"slurm.partition={s.partition}"])


def submit(config: RunConfig | str | Path | None = None, *, run_dir: str | Path | None = None,
           folder: str | Path | None = None, **overrides: Any) -> TrainJob:
    """Submit training as a submitit job; returns it (`.result(timeout)`, `.state`, `.cancel()`).

    `config` is a RunConfig, a config file, or None for ./config.yaml (or the defaults). Overrides are
    config keys with `__` for the dot: `submit("config.yaml", train__max_steps=1000, slurm__nodes=2)`.
    """
    if isinstance(config, RunConfig):
        cfg = with_overrides(config, _sets(overrides)) if overrides else config
    else:
        cfg = load_config(config_files(config), _sets(overrides))
    target = Path(run_dir or default_run_dir(cfg)).resolve()
    code = snapshot(cfg, Path.cwd(), RunDir(target).code) if snapshots(cfg.slurm) else None
    cfg = job_config(cfg, Path.cwd(), code) if code else cfg
    executor = submitit.AutoExecutor(folder=Path(folder or target / "submitit"),
                                     slurm_max_num_timeout=cfg.slurm.max_restarts, slurm_python=container_python(cfg))
    if executor.cluster != "slurm":
        raise QgtrainError("submit: no Slurm found here (srun is not on PATH); run this on a Slurm login node, "
                           "or train directly with `qgtrain train`")
    recover_args = _recover_args(cfg, target)
    executor.update_parameters(**executor_parameters(cfg, recover_args=recover_args, code=code))
    submitit_compat.use_job_class(executor, TrainJob)
    # submitit's folder inside the run directory would create it with the umask's mode
    if folder is None:
        create(target, cfg.logging.shared)
    return cast(TrainJob, executor.submit(TrainTask(config_to_dict(cfg), str(target))))


def submit_sweep(config: RunConfig | str | Path | None, values: Mapping[str, Sequence[Any]] | Sweep, *,
                 max_parallel: int | None = None) -> list[TrainJob]:
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
    sweep.array_spec(len(planned.configs), max_parallel)  # a Sweep given (by the CLI) was checked by its maker
    where = sweep.folder(planned)
    planned, code = sweep.from_snapshot(planned, where)
    first = planned.configs[0]
    sweep.write(planned, where)
    executor = submitit.AutoExecutor(folder=where / "submitit", slurm_max_num_timeout=first.slurm.max_restarts,
                                     slurm_python=container_python(first))
    if executor.cluster != "slurm":
        raise QgtrainError("submit_sweep: no Slurm found here (srun is not on PATH); run this on a Slurm login node")
    each_task = f'--config {shlex.quote(str(where))}"/task-${{SLURM_ARRAY_TASK_ID}}.yaml"'  # its run, its settings
    executor.update_parameters(**executor_parameters(first, recover_args=each_task, code=code),
                               slurm_array_parallelism=max_parallel or len(planned.configs))
    submitit_compat.use_job_class(executor, TrainJob)
    with executor.batch():
        jobs = [executor.submit(TrainTask(config_to_dict(cfg), str(default_run_dir(cfg).resolve())))
                for cfg in planned.configs]
    # submitit makes an array's jobs plain SlurmJobs: the same jobs, seen through our watcher and deadlines
    return [TrainJob(folder=executor.folder, job_id=job.job_id, tasks=list(range(job.num_tasks))) for job in jobs]


def _sets(overrides: dict[str, Any]) -> list[str]:
    return [f"{key.replace('__', '.')}={_text(value)}" for key, value in overrides.items()]


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(repr(str(v)) for v in value) + "]"
    return "null" if value is None else str(value)
