"""The composition root of `qgtrain train`: the one place where the parts are built and connected.

environment -> device and process group -> run directory (rank 0 decides) -> data -> model -> resume
-> train -> on a stop signal: checkpoint, requeue, documented exit code -> process group destroyed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import torch

from .config import RunConfig, duration_s
from .configload import config_to_dict, dump_yaml
from .data.loaders import build_loaders
from .errors import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_REQUEUE_ME,
    EXIT_STOPPED,
    PeerFailure,
    QgtrainError,
)
from .runtime import compile_cache, cpu, distributed, log, precision, rng
from .runtime.deadline import Deadline
from .runtime.rendezvous import DistEnv
from .runtime.signals import (
    StopFlag,
    job_state,
    reason_not_to_requeue,
    requeue,
    seconds_left,
)
from .runtime.startup import Timeline
from .state import checkpoint, rundir
from .state.checkpointer import Checkpointer
from .state.resume import data_change, pick_for_resume
from .task import Task
from .tasks.build import TaskSource, build_task, task_spec
from .training import parallel, trackers
from .training.metrics import MetricsLog
from .training.optim import adamw
from .training.trainer import Outcome, Parts, Settings, Trainer

logger = logging.getLogger("qgtrain")
EXPORT_TIMEOUT_S = 6 * 3600.0


def train(cfg: RunConfig, env: DistEnv, run_dir: str | Path | None = None, *, requeue_on_stop: bool = True,
          task: TaskSource | None = None) -> int:
    """Train to the end, to an early stop, or to an agreed stop on a signal or before the time limit.
    Returns the exit code."""
    deadline = _deadline(cfg, env, time.time())  # train.max_time counts from here
    timeline = Timeline()
    log.setup_console(env, cfg.logging.level)
    device = distributed.pick_device(env, cfg.train.device)
    if device.type == "cpu":
        cpu.set_cpu_threads(env, cfg.train.cpu_threads)
        cpu.keep_freed_memory()
    # The stop handlers stay until after the requeue: `scontrol requeue` SIGTERMs this job's own tasks.
    stop = StopFlag([cfg.slurm.signal, "TERM"])
    cfg = _with_pretrained_tokenizer(cfg)  # before the config is recorded: the run's copies must agree
    if task is not None and (spec := task_spec(task)):
        cfg = dataclasses.replace(cfg, task=dataclasses.replace(cfg.task, factory=spec))
    elif task is not None:
        logger.warning("the task was given as an object, so the run's config cannot name it: a requeued job, "
                       "`qgtrain train` and `qgtrain export` would build %s instead. HINT: pass the function that "
                       "makes the Task (task=my_task), defined at the top level of a module", cfg.task.factory)
    try:
        with stop, distributed.process_group(env, device, cfg.train.startup_timeout_s,
                                             cfg.train.collective_timeout_s):
            timeline.mark("process group")
            outcome, run_dir = _train_in_group(cfg, env, device, Path(run_dir) if run_dir else None, stop, task,
                                               deadline, timeline)
            if outcome is Outcome.STOPPED_BY_SIGNAL:
                return _after_stop(cfg, env, requeue_on_stop, run_dir)
            if cfg.export.on_finish:
                return _export_on_finish(cfg, run_dir)
            distributed.barrier()
            return EXIT_OK
    finally:
        deadline.close()
        log.close()


def _train_in_group(cfg: RunConfig, env: DistEnv, device: torch.device, run_dir: Path | None, stop: StopFlag,
                    task: TaskSource | None, deadline: Deadline, timeline: Timeline) -> tuple[Outcome, Path]:
    config_yaml = dump_yaml(cfg)  # one text for the run directory and, through it, every checkpoint
    with contextlib.ExitStack() as stack:
        # Rank 0 picks the directory (absolute, as it sees it), holds its lock while training, and picks the
        # checkpoint to resume from before it writes anything there: a refusal leaves the run as it was.
        def claim() -> tuple[Path, str, str | None, list[str]]:
            path = (run_dir or rundir.default_run_dir(cfg)).resolve()
            try:
                stack.enter_context(rundir.exclusive(path, f"Slurm job {env.job_id}" if env.job_id else "qgtrain"))
                warnings: list[str] = []  # logged once the run's log file is open
                ckpt = pick_for_resume(path / "checkpoints", rundir.read_run_id(path), cfg.checkpoint.resume,
                                       warnings.append)
                return path, rundir.open_run(path, cfg, config_yaml), str(ckpt.path) if ckpt else None, warnings
            except OSError as exc:
                raise QgtrainError(f"the run directory {path} cannot be written ({exc.strerror or exc}: "
                                   f"{exc.filename or path}). HINT: choose a writable place with --run-dir or "
                                   "logging.runs_dir, or free space there") from None

        path, run_id, resume_from, warnings = distributed.main_decides(claim)
        _check_shared(path, run_id, env, device)
        timeline.mark("run directory")
        if env.is_main:
            rundir.write_status(path, "running", job_id=env.requeue_id, restart=env.restart_count, error=None,
                                host=env.node_name, ranks=env.world_size, started=time.time())
        try:
            ckpt = checkpoint.read_manifest(Path(resume_from)) if resume_from else None
            outcome = _train_in_run(cfg, env, device, path, run_id, ckpt, warnings, stop, task, deadline, timeline)
        except PeerFailure as exc:  # another rank stopped first: say which, and why, if it left a note
            note = rundir.read_failure_note(path, env.rank, env.world_size)
            error = PeerFailure(f"{note}; rank {env.rank} stopped with it" if note else str(exc))
            logger.error("%s", error)
            if env.is_main:
                rundir.write_status(path, "failed", error=str(error))
            raise error from exc
        except BaseException as exc:  # this rank's own failure: noted for the others before the group goes
            rundir.write_failure_note(path, env.rank, _first_line(exc))
            if isinstance(exc, QgtrainError):
                logger.error("%s", exc)  # every rank records why it stopped
            if env.is_main:
                rundir.write_status(path, "failed", error=str(exc) if isinstance(exc, QgtrainError) else
                                    _first_line(exc))
            raise
        if env.is_main:
            rundir.write_status(path, {Outcome.FINISHED: "finished", Outcome.EARLY_STOPPED: "stopped early",
                                       Outcome.STOPPED_BY_SIGNAL: "preempted"}[outcome])
    return outcome, path


def _train_in_run(cfg: RunConfig, env: DistEnv, device: torch.device, run_dir: Path, run_id: str,
                  ckpt: checkpoint.Checkpoint | None, warnings: list[str], stop: StopFlag,
                  task_source: TaskSource | None, deadline: Deadline, timeline: Timeline) -> Outcome:
    log.add_rank_file(env, run_dir / "logs", cfg.logging.level)
    rundir.clear_failure_note(run_dir, env.rank)
    for warning in warnings if env.is_main else []:
        logger.warning("%s", warning)
    if cfg.model.pretrained and cfg.data.tokenizer == cfg.model.pretrained:
        logger.info("using the tokenizer of model.pretrained (%s)", cfg.model.pretrained)
    logger.info("run directory %s (run id %s), %d rank(s) on %d node(s), device %s", run_dir, run_id,
                env.world_size, env.num_nodes, device)
    logger.info("rank %d on node %s (local rank %d), rendezvous %s:%d%s", env.rank, env.node_name, env.local_rank,
                env.master_addr, env.master_port,
                f", Slurm job {env.requeue_id} restart {env.restart_count}" if env.in_slurm_job else "")
    rng.seed_everything(cfg.train.seed)  # identical initial weights on every rank
    task = build_task(cfg, task_source)
    rng.seed_everything(cfg.train.seed + 7919 * env.rank)  # dropout differs per rank, reproducibly
    if ckpt is not None and env.is_main and (changed := data_change(ckpt, task.facts)):
        logger.warning("%s", changed)
    timeline.mark("task")
    model = task.model
    logger.info("task %s: model %s with %.2fM parameters", cfg.task.factory, type(model).__name__,
                sum(p.numel() for p in model.parameters()) / 1e6)
    extra = {"config.yaml": (run_dir / "config.yaml").read_bytes(),  # rank 0's record: the copies cannot differ
             "model.json": json.dumps({"class": type(model).__name__, **task.facts}).encode()}
    if hasattr(model, "config") and hasattr(model.config, "to_json_string"):
        extra["hf_config.json"] = model.config.to_json_string().encode()
    checkpointer = Checkpointer(run_dir / "checkpoints", run_id, env, cfg.checkpoint.keep_last,
                                cfg.checkpoint.async_save, extra)
    bar = cfg.logging.progress == "bar" or (cfg.logging.progress == "auto" and sys.stderr.isatty())
    trackers.check_installed(cfg.logging.trackers)
    metrics = MetricsLog(run_dir, env.is_main, cfg.logging.tensorboard or "tensorboard" in cfg.logging.trackers,
                         ckpt.step if ckpt else None, progress_bar=bar, max_steps=cfg.train.max_steps,
                         memory_warn_gb=cfg.logging.memory_warn_gb, timeline=timeline,
                         trackers=trackers.open_trackers(cfg.logging, run_dir, run_dir.name, config_to_dict(cfg))
                         if env.is_main else [])
    resolved = precision.resolve(cfg.train.precision, device)
    outcome = None
    try:
        with compile_cache.in_run_dir(run_dir, env.rank) if cfg.model.compile else contextlib.nullcontext():
            trainer = Trainer(_parts(cfg, env, device, task, resolved, checkpointer, metrics, stop, deadline),
                              Settings(cfg.train, cfg.optim, cfg.early_stopping, cfg.checkpoint, resolved), env,
                              device)
            timeline.mark("wrapping and loaders")
            if ckpt is not None:
                trainer.restore(ckpt)
                timeline.mark("restore")
            outcome = trainer.fit()
            checkpointer.wait()
    finally:
        metrics.close(finished=outcome in (Outcome.FINISHED, Outcome.EARLY_STOPPED))
    return outcome


def _parts(cfg: RunConfig, env: DistEnv, device: torch.device, task: Task, resolved_precision: str,
           checkpointer: Checkpointer, metrics: MetricsLog, stop: StopFlag, deadline: Deadline) -> Parts:
    model = task.model.to(device)
    wrapped = parallel.wrap(model, env, device, cfg.model.compile, cfg.train, resolved_precision)
    assert task.collate is not None
    loaders = build_loaders(task.train, task.val, task.test, task.collate, env, cfg.train.batch_size,
                            cfg.data.num_workers, device, cfg.train.seed)
    return Parts(task, model, wrapped, adamw(model, cfg.optim, device),
                 precision.grad_scaler(resolved_precision, device),
                 loaders.sampler, loaders.train, loaders.val, loaders.test, checkpointer, metrics, stop, deadline)


def _deadline(cfg: RunConfig, env: DistEnv, started: float) -> Deadline:
    """Rank 0's: train.max_time from this process's start, and the Slurm job's limit, read again now and then."""
    if not env.is_main:
        return Deadline(None, None, cfg.train.stop_margin_s)
    max_time = duration_s(cfg.train.max_time) if cfg.train.max_time else None
    local_end = started + max_time if max_time else None
    if not env.in_slurm_job:
        return Deadline(local_end, None, cfg.train.stop_margin_s)

    def job_end() -> float | None:
        left = seconds_left(str(env.job_id))
        return None if left is None else time.time() + left

    return Deadline(local_end, env.job_end_time, cfg.train.stop_margin_s, job_end, cfg.train.time_limit_check_s)


def _check_shared(path: Path, run_id: str, env: DistEnv, device: torch.device) -> None:
    """Every rank must see the run directory rank 0 just claimed: checkpoints are written into one folder
    by all ranks. Checked before anything is built, on every rank (a collective)."""
    blind = distributed.flagged_ranks(rundir.read_run_id(path) != run_id, device)
    if blind:
        raise QgtrainError(
            f"rank(s) {blind} do not see the run directory {path} that rank 0 created on {env.master_addr}: each "
            "node sees its own folder at that path. HINT: the run directory must be on a filesystem every node "
            "mounts (a shared filesystem); point logging.runs_dir or --run-dir there (`srun qgtrain doctor` checks)")


def _first_line(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, QgtrainError) else f"{type(exc).__name__}: {exc}"
    return (text.strip().splitlines() or [type(exc).__name__])[0][:500]


def _with_pretrained_tokenizer(cfg: RunConfig) -> RunConfig:
    """model.pretrained brings its own tokenizer unless data.tokenizer names one: fine-tuning on a
    different tokenization would silently feed the model the wrong ids."""
    pretrained = cfg.model.pretrained
    if pretrained and cfg.data.tokenizer == "byte" and Path(pretrained, "tokenizer.json").is_file():
        return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=pretrained))
    return cfg


def _after_stop(cfg: RunConfig, env: DistEnv, requeue_on_stop: bool, run_dir: Path) -> int:
    """After the agreed checkpoint: rank 0 requeues the Slurm job; every rank returns the same code."""
    result = None
    if env.is_main:
        requeued = _decide_requeue(cfg, env, requeue_on_stop)
        result = EXIT_REQUEUE_ME if requeued is None else EXIT_STOPPED
        rundir.write_status(run_dir, "preempted", requeued=requeued)
    return int(distributed.broadcast_from_main(result))


def _decide_requeue(cfg: RunConfig, env: DistEnv, requeue_on_stop: bool) -> bool | None:
    """Rank 0: requeue if this is a running Slurm job that should come back. True if requeued, False if
    it should not be, None if it should but could not be from here (the batch shell then does it)."""
    if not requeue_on_stop:
        logger.warning("stopped at a checkpoint; the launcher decides about requeueing")
        return False
    if not env.in_slurm_job:
        logger.warning("stopped at a checkpoint: run the same command again to resume")
        return False
    if not cfg.slurm.requeue or env.restart_count >= cfg.slurm.max_restarts:
        logger.warning("stopped at a checkpoint; not requeued (slurm.requeue=%s, restart %d of at most %d)",
                       cfg.slurm.requeue, env.restart_count, cfg.slurm.max_restarts)
        return False
    reason = reason_not_to_requeue(job_state(str(env.job_id)), env.restart_count)
    if reason:
        logger.warning("stopped at a checkpoint; %s", reason)
        return False
    done, message = requeue(str(env.requeue_id))
    logger.warning("stopped at a checkpoint: %s", message)
    return True if done else None


def _export_on_finish(cfg: RunConfig, run_dir: Path) -> int:
    """Rank 0 runs `qgtrain export` in a child process (a fresh one-process group on the CPU, and memory
    of its own); every rank returns its outcome. Training is finished and checkpointed either way."""
    out = Path(cfg.export.dir) if cfg.export.dir else run_dir / "export"

    def export() -> tuple[int, str]:
        logger.info("exporting the final checkpoint to %s", out)
        argv = ["export", str(run_dir), "--out", str(out), "--force"]
        code = f"import sys; sys.path[:0] = {sys.path!r}; from qgtrain.cli import main; sys.exit(main({argv!r}))"
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        said = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or [""])[-1]
        return done.returncode, said

    returncode, said = distributed.main_works_long(export, f"is exporting to {out}", ("its limit", EXPORT_TIMEOUT_S))
    if returncode != 0:
        logger.error("training finished, but the export failed (exit %d): %s. HINT: the checkpoints are intact; "
                     "fix the cause and run `qgtrain export %s --out %s`", returncode, said, run_dir, out)
        return EXIT_FAILED
    logger.info("%s", said)
    return EXIT_OK
