"""The composition root of `qgtrain train`: the one place where the parts are built and connected.

environment -> device and process group -> run directory (rank 0 decides) -> data -> model -> resume
-> train -> on a stop signal: checkpoint, requeue, documented exit code -> process group destroyed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

from .config import RunConfig
from .configload import dump_yaml
from .data import corpus
from .data.loaders import build_splits
from .errors import EXIT_OK, EXIT_REQUEUE_ME, EXIT_STOPPED, ConfigError, QgtrainError
from .runtime import cpu, distributed, log, rng
from .runtime.rendezvous import DistEnv
from .runtime.signals import StopFlag, job_state, reason_not_to_requeue, requeue
from .state import checkpoint, rundir
from .state.checkpointer import Checkpointer
from .tasks.models import build_model
from .training.metrics import MetricsLog
from .training.trainer import Outcome, Trainer

logger = logging.getLogger("qgtrain")


def train(cfg: RunConfig, env: DistEnv, run_dir: str | Path | None = None, *, requeue_on_stop: bool = True) -> int:
    """Train to the end, to an early stop, or to an agreed stop on a signal. Returns the exit code."""
    log.setup_console(env, cfg.logging.level)
    device = distributed.pick_device(env, cfg.train.device)
    if device.type == "cpu":
        cpu.set_cpu_threads(env, cfg.train.cpu_threads)
        cpu.keep_freed_memory()
    # The stop handlers stay until after the requeue: `scontrol requeue` SIGTERMs this job's own tasks.
    stop = StopFlag([cfg.slurm.signal, "TERM"])
    cfg = _with_pretrained_tokenizer(cfg)  # before the config is recorded: the run's copies must agree
    try:
        with stop, distributed.process_group(env, device, cfg.train.startup_timeout_s,
                                             cfg.train.collective_timeout_s):
            outcome, run_dir = _train_in_group(cfg, env, device, Path(run_dir) if run_dir else None, stop)
            if outcome is Outcome.STOPPED_BY_SIGNAL:
                return _after_stop(cfg, env, requeue_on_stop, run_dir)
            if cfg.export.on_finish and env.is_main:
                _export_on_finish(cfg, run_dir)
            distributed.barrier()
            return EXIT_OK
    finally:
        log.close()


def _train_in_group(cfg: RunConfig, env: DistEnv, device: object, run_dir: Path | None,
                    stop: StopFlag) -> tuple[Outcome, Path]:
    with contextlib.ExitStack() as stack:
        # Rank 0 picks the directory (absolute, as it sees it), holds its lock while training, and picks the
        # checkpoint to resume from before it writes anything there: a refusal leaves the run as it was.
        def claim() -> tuple[Path, str, str | None, list[str]]:
            path = (run_dir or rundir.default_run_dir(cfg)).resolve()
            stack.enter_context(rundir.exclusive(path, f"Slurm job {env.job_id}" if env.job_id else "qgtrain"))
            warnings: list[str] = []  # logged once the run's log file is open
            ckpt = checkpoint.pick_for_resume(path / "checkpoints", rundir.read_run_id(path), cfg.checkpoint.resume,
                                              warnings.append)
            return path, rundir.open_run(path, cfg, dump_yaml(cfg)), str(ckpt.path) if ckpt else None, warnings

        path, run_id, resume_from, warnings = distributed.main_decides(claim)
        if env.is_main:
            rundir.write_status(path, "running", job_id=env.requeue_id, restart=env.restart_count, error=None,
                                host=env.node_name, ranks=env.world_size, started=time.time())
        try:
            ckpt = checkpoint.read_manifest(Path(resume_from)) if resume_from else None
            outcome = _train_in_run(cfg, env, device, path, run_id, ckpt, warnings, stop)
        except QgtrainError as exc:
            logger.error("%s", exc)  # every rank records why it stopped
            if env.is_main:
                rundir.write_status(path, "failed", error=str(exc))
            raise
        except BaseException as exc:  # a bug or an interrupt: recorded, then raised with its traceback
            if env.is_main:
                rundir.write_status(path, "failed", error=f"{type(exc).__name__}: {exc}"[:500])
            raise
        if env.is_main:
            rundir.write_status(path, {Outcome.FINISHED: "finished", Outcome.EARLY_STOPPED: "stopped early",
                                       Outcome.STOPPED_BY_SIGNAL: "preempted"}[outcome])
    return outcome, path


def _train_in_run(cfg: RunConfig, env: DistEnv, device: object, run_dir: Path, run_id: str,
                  ckpt: checkpoint.Checkpoint | None, warnings: list[str], stop: StopFlag) -> Outcome:
    log.add_rank_file(env, run_dir / "logs", cfg.logging.level)
    for warning in warnings if env.is_main else []:
        logger.warning("%s", warning)
    if cfg.model.pretrained and cfg.data.tokenizer == cfg.model.pretrained:
        logger.info("using the tokenizer of model.pretrained (%s)", cfg.model.pretrained)
    logger.info("run directory %s (run id %s), %d rank(s) on %d node(s), device %s", run_dir, run_id,
                env.world_size, env.num_nodes, device)
    logger.info("rank %d on node %s (local rank %d), rendezvous %s:%d%s", env.rank, env.node_name, env.local_rank,
                env.master_addr, env.master_port,
                f", Slurm job {env.requeue_id} restart {env.restart_count}" if env.in_slurm_job else "")
    prepared = None
    if cfg.data.name == "corpus":
        # Rank 0 tokenizes (once per corpus and tokenizer); the others open the files it wrote.
        prepared = corpus.load(distributed.main_decides(lambda: corpus.prepare(cfg.data).folder))
    splits = build_splits(cfg.data, prepared, cfg.train.seed)
    rng.seed_everything(cfg.train.seed)  # identical initial weights on every rank
    model = build_model(cfg.model, splits.vocab_size, cfg.data.seq_len, prepared.eos_id if prepared else None)
    rng.seed_everything(cfg.train.seed + 7919 * env.rank)  # dropout differs per rank, reproducibly
    logger.info("model: %s with %.2fM parameters", type(model).__name__, sum(p.numel() for p in model.parameters()) / 1e6)
    embeddings = getattr(model, "get_input_embeddings", lambda: None)()
    if embeddings is not None and embeddings.num_embeddings < splits.vocab_size:
        raise ConfigError(f"data.tokenizer: {cfg.data.tokenizer} has {splits.vocab_size} tokens but the model "
                          f"embeds only {embeddings.num_embeddings}; use the tokenizer the model was trained with")
    facts = {"vocab_size": splits.vocab_size, "seq_len": cfg.data.seq_len, "class": type(model).__name__,
             "eos_id": prepared.eos_id if prepared else (256 if cfg.data.name == "synthetic" else None),
             "tokenizer": {"corpus": cfg.data.tokenizer, "synthetic": "byte"}.get(cfg.data.name)}
    extra = {"config.yaml": dump_yaml(cfg).encode(), "model.json": json.dumps(facts).encode()}
    if hasattr(model, "config") and hasattr(model.config, "to_json_string"):
        extra["hf_config.json"] = model.config.to_json_string().encode()
    checkpointer = Checkpointer(run_dir / "checkpoints", run_id, env, cfg.checkpoint.keep_last,
                                cfg.checkpoint.async_save, extra)
    bar = cfg.logging.progress == "bar" or (cfg.logging.progress == "auto" and sys.stderr.isatty())
    metrics = MetricsLog(run_dir, env.is_main, cfg.logging.tensorboard, ckpt.step if ckpt else None,
                         progress_bar=bar, max_steps=cfg.train.max_steps)
    try:
        trainer = Trainer(cfg, env, device, model, splits, checkpointer, metrics, stop)  # type: ignore[arg-type]
        if ckpt is not None:
            trainer.restore(ckpt)
        outcome = trainer.fit()
        checkpointer.wait()
    finally:
        metrics.close()
    return outcome


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


def _export_on_finish(cfg: RunConfig, run_dir: Path) -> None:
    from .ops.export import export_run

    export_run(run_dir, Path(cfg.export.dir) if cfg.export.dir else run_dir / "export", force=True)
