"""The composition root of `qgtrain train`: the one place where the parts are built and connected.

environment -> device and process group -> run directory (rank 0 decides) -> task -> model, data,
checkpointer, metrics -> resume -> train -> on a stop: requeue and the documented exit code; on
finish: export if asked -> process group destroyed. Policy lives in the modules named here; this
file composes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import RunConfig
from .config.model import with_pretrained_tokenizer
from .config.slurm import micro_batches, ranks_per_node
from .data.loaders import loaders_for
from .evals.downstream import downstream_for
from .foundation.errors import EXIT_OK, EXIT_REQUEUE_ME, EXIT_STOPPED
from .foundation.pinned import Pinned
from .foundation.task import ReadyTask
from .ops.export.on_finish import export_on_finish
from .runs import rundir
from .runs.claim import Claim, claimed, pinned_here
from .runs.lifecycle import Lifecycle
from .runtime import comms, compile_cache, cpu, diagnose, distributed, log, precision, rng, slurm
from .runtime.deadline import Deadline, deadline_for
from .runtime.rendezvous import DistEnv
from .runtime.signals import StopFlag
from .runtime.startup import Timeline
from .state import checkpoint, layout, local_tier
from .state.checkpointer import Checkpointer
from .state.resume import data_change
from .state.train_state import Outcome
from .tasks import warm_imports
from .tasks.build import TaskSource, build_task, naming_the_task
from .training import trackers
from .training.assembly import assemble
from .training.goodput import Account
from .training.metrics import MetricsLog
from .training.optimizers import build_optimizer, name_of
from .training.parallel.strategy import Strategy, strategy_for
from .training.parts import LoopParts, Settings
from .training.profiling import StepProfiler
from .training.trainer import Trainer
from .training.transforms import transformed

logger = logging.getLogger("qgtrain")
STATUS = {
    Outcome.FINISHED: "finished",
    Outcome.EARLY_STOPPED: "stopped early",
    Outcome.STOPPED_TO_RESUME: "preempted",
}


@dataclass(frozen=True)
class RunContext:
    """What every part of one start of a run shares."""

    cfg: RunConfig
    env: DistEnv
    device: torch.device
    stop: StopFlag
    deadline: Deadline
    timeline: Timeline
    task: TaskSource | None


def train(
    cfg: RunConfig,
    env: DistEnv,
    run_dir: str | Path | None = None,
    *,
    requeue_on_stop: bool = True,
    task: TaskSource | None = None,
) -> int:
    """Train to the end, to an early stop, or to an agreed stop on a signal or before the time
    limit. Returns the exit code."""
    deadline = deadline_for(cfg.train, env, lambda: slurm.seconds_left(str(env.job_id)))
    timeline = Timeline()
    log.setup_console(env, cfg.logging.level)
    device = distributed.pick_device(env, cfg.train.device)
    if device.type == "cpu":
        cpu.set_cpu_threads(env, cfg.train.cpu_threads)
        cpu.keep_freed_memory()
    cfg = naming_the_task(with_pretrained_tokenizer(cfg), task)
    warm_imports.start(cfg)  # transformers, while the group forms (the task build joins it)
    try:
        # The stop handlers stay until after the requeue: `scontrol requeue` SIGTERMs this job's own
        # tasks.
        with (
            StopFlag([cfg.slurm.signal, "TERM"]) as stop,
            distributed.process_group_for(env, device, cfg.train),
        ):
            timeline.mark("process group")
            ctx = RunContext(cfg, env, device, stop, deadline, timeline, task)
            outcome, path = _train_in_group(ctx, Path(run_dir) if run_dir else None)
            if outcome is Outcome.STOPPED_TO_RESUME:
                return _after_stop(ctx, path, requeue_on_stop)
            if cfg.export.on_finish:
                return export_on_finish(cfg, path)
            distributed.barrier()
            return EXIT_OK
    finally:
        deadline.close()
        log.close()


def _train_in_group(ctx: RunContext, run_dir: Path | None) -> tuple[Outcome, Path]:
    with contextlib.ExitStack() as held:
        claim = claimed(ctx.cfg, ctx.env, ctx.device, run_dir, held)
        pin = pinned_here(claim, ctx.env.is_main)  # checked before each save and compile
        ctx.timeline.mark("run directory")
        lifecycle = Lifecycle(claim.path, ctx.env)
        with lifecycle.failures_recorded():
            log.add_rank_file(ctx.env, claim.run.rank_log(ctx.env.rank), ctx.cfg.logging.level)
            comms.keep_nccl_dumps(claim.run.nccl_dumps, ctx.env, ctx.device.type)
            lifecycle.started()
            with diagnose.peers_watched(ctx.env, ctx.cfg.train.collective_timeout_s):
                outcome = _train_in_run(ctx, claim, pin, lifecycle)
        lifecycle.ended(STATUS[outcome])
    return outcome, claim.path


def _train_in_run(ctx: RunContext, claim: Claim, pin: Pinned, lifecycle: Lifecycle) -> Outcome:
    cfg, env = ctx.cfg, ctx.env
    for warning in claim.warnings if env.is_main else []:
        logger.warning("%s", warning)
    _log_start(ctx, claim)
    ckpt = checkpoint.read_manifest(Path(claim.resume_from)) if claim.resume_from else None
    strategy = strategy_for(cfg.train, env, ctx.device)  # how the ranks hold the model
    tier = _local_tier(cfg, env, claim.run_id, strategy)
    # a node-local checkpoint newer than the shared one (local_tier.py: agreed by every rank)
    local = tier.newest(after=ckpt.step if ckpt else 0) if tier and _reads_local(cfg) else None
    rng.seed_everything(cfg.train.seed)  # identical initial weights on every rank
    # an adapter run's checkpoint holds no base: it is built (or read) again as at the start
    holds_all = (ckpt is not None or local is not None) and cfg.model.adapter == "none"
    task = build_task(
        cfg,
        ctx.task,
        empty=strategy.builds_empty(holds_all),
        resumed_from=ckpt.path if ckpt else None,  # the model the run began with
    )
    # adapters and the other transforms, drawn with the same seed on every rank
    task = dataclasses.replace(task, model=transformed(task.model, cfg, strategy))
    # dropout differs per rank, reproducibly
    rng.seed_everything(rng.rank_seed(cfg.train.seed, env.rank))
    if ckpt is not None and env.is_main and (changed := data_change(ckpt, task.facts)):
        logger.warning("%s", changed)
    ctx.timeline.mark("task")
    logger.info(
        "task %s: model %s with %.2fM parameters (%.3gM trained)",
        cfg.task.factory,
        type(task.model).__name__,
        sum(p.numel() for p in task.model.parameters()) / 1e6,
        sum(p.numel() for p in task.model.parameters() if p.requires_grad) / 1e6,
    )
    resumed = local or ckpt
    metrics = trackers.metrics_log(
        cfg, claim.path, env, resumed.step if resumed else None, ctx.timeline
    )
    outcome = None
    try:
        with (
            compile_cache.in_run_dir(claim.path, env.rank, pin, claim.run_id)
            if cfg.model.compile
            else contextlib.nullcontext()
        ):
            trainer = _trainer(ctx, claim, pin, task, metrics, strategy, tier)
            ctx.timeline.mark("wrapping and loaders")
            if resumed is not None:
                trainer.restore(resumed)
                lifecycle.resumed(resumed.step, "node-local" if local else "shared")
                ctx.timeline.mark("restore")
            lifecycle.training()  # a failure from here on is the run's, not a refused start
            outcome = trainer.fit()
    finally:
        metrics.close(finished=outcome in (Outcome.FINISHED, Outcome.EARLY_STOPPED))
    return outcome


def _local_tier(
    cfg: RunConfig, env: DistEnv, run_id: str, strategy: Strategy
) -> local_tier.LocalTier | None:
    """checkpoint.local_dir's tier on this node (each rank checks its node's folder)."""
    if not cfg.checkpoint.local_dir:
        return None
    by_shards, train = strategy.saves_shards, cfg.train
    return local_tier.opened(
        cfg.checkpoint, env, run_id, by_shards, train.parallel, train.collective_timeout_s
    )


def _reads_local(cfg: RunConfig) -> bool:
    """checkpoint.resume: auto takes the newest tier; a named checkpoint, or never, is what it
    says."""
    return cfg.checkpoint.resume == "auto"


def _at_this_size(cfg: RunConfig, env: DistEnv) -> RunConfig:
    """The config a step on fewer nodes than slurm.nodes trains with (slurm.min_nodes): more
    micro-batches a step, the global batch kept."""
    if not env.in_slurm_job:
        return cfg
    micro = micro_batches(cfg.slurm, cfg.train.grad_accum_steps, env.world_size)
    if micro == cfg.train.grad_accum_steps:
        return cfg
    logger.info(
        "%d rank(s), fewer than slurm.nodes' %d (slurm.min_nodes): %d micro-batches a step keep "
        "the global batch",
        env.world_size,
        cfg.slurm.nodes * ranks_per_node(cfg.slurm),
        micro,
    )
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, grad_accum_steps=micro))


def _log_start(ctx: RunContext, claim: Claim) -> None:
    cfg, env = ctx.cfg, ctx.env
    if cfg.model.pretrained and cfg.data.tokenizer == cfg.model.pretrained:
        logger.info("using the tokenizer of model.pretrained (%s)", cfg.model.pretrained)
    logger.info(
        "run directory %s (run id %s), %d rank(s) on %d node(s), device %s",
        claim.path,
        claim.run_id,
        env.world_size,
        env.num_nodes,
        ctx.device,
    )
    logger.info("%s", log.where_this_rank_runs(env))


def _trainer(
    ctx: RunContext,
    claim: Claim,
    pin: Pinned,
    task: ReadyTask,
    metrics: MetricsLog,
    strategy: Strategy,
    tier: local_tier.LocalTier | None,
) -> Trainer:
    cfg, env, device = ctx.cfg, ctx.env, ctx.device
    run = claim.run
    run_files = layout.run_files(run.config.read_bytes(), task.model, task.facts)
    checkpointer = Checkpointer.for_run(
        run.checkpoints, claim.run_id, env, cfg, run_files, pin, strategy.saves_shards, tier
    )
    resolved = precision.resolve(cfg.train.precision, device)
    loaders = loaders_for(task, cfg, env, device)
    parallel = strategy.setup(
        task.model,
        cfg.model.compile,
        resolved,
        lambda: build_optimizer(task, cfg.optim, device),
        precision.grad_scaler(resolved, device),
    )
    whose = " (the task's)" if task.optimizer else ""
    logger.info(
        "optimizer %s%s, schedule %s", name_of(parallel.optimizer), whose, cfg.optim.schedule
    )
    parts = LoopParts(
        task=task,
        parallel=parallel,
        loaders=loaders,
        checkpointer=checkpointer,
        metrics=metrics,
        stop=ctx.stop,
        deadline=ctx.deadline,
        profiler=StepProfiler.for_run(cfg.train, run, env.rank, device),
        downstream=downstream_for(
            cfg, task.model, task.facts, strategy, resolved, run.eval, metrics.write_samples
        ),
        account=Account(pin, env.job_start_time) if env.is_main else None,
    )
    # pins an async save's host buffers in the background
    checkpointer.prepare(task.model, parallel.optimizer, strategy.copies_to_save())
    settings = Settings.of(_at_this_size(cfg, env), resolved)
    return Trainer(parts, settings, env, device, assemble(parts, settings, env, device))


def _after_stop(ctx: RunContext, path: Path, requeue_on_stop: bool) -> int:
    """After the agreed checkpoint: rank 0 requeues the Slurm job; every rank returns the same
    code."""
    result = None
    if ctx.env.is_main:
        requeued, said = (
            slurm.decide_requeue(ctx.cfg.slurm, ctx.env)
            if requeue_on_stop
            else (False, "the launcher decides about requeueing")
        )
        logger.warning("stopped at a checkpoint; %s", said)
        result = EXIT_REQUEUE_ME if requeued is None else EXIT_STOPPED
        rundir.write_status(path, "preempted", requeued=requeued)
    return int(distributed.broadcast_from_main(result))
