"""`qgtrain eval`: eval.tasks, and the task's own loss and metrics on its val and test splits
(eval_figures.py), on a finished run's checkpoints, or on an export.

On 1 or N ranks (torchrun, srun: the same rendezvous as `train`), each rank scoring its share of
the items (evals/downstream.py) and of the splits, and holding the whole model, or its shards where
the run trained sharded (_holder). A checkpoint's model is rebuilt as export rebuilds it and its
weights read from the checkpoint of either kind (rank 0's files or DCP shards), the EMA's under
train.eval_ema, as the loop would have scored it. Results go to <run>/eval/results.jsonl
(eval_results.py): a killed `--all` started again skips every (step, task or split) already scored
as now asked, so each is scored once. A run or export that is not the user's is scored into a
folder of the user's instead, with the user's eval.tasks only (eval_out.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import RunConfig
from ..config.load import config_files, load_config
from ..data import tokenizer
from ..evals.downstream import Downstream, downstream_for
from ..foundation.errors import QgtrainError
from ..foundation.folder_code import trusting_its_flag
from ..foundation.task import BUILTIN_LM
from ..runs.rundir import RunDir
from ..runtime import distributed, log, precision
from ..runtime.rendezvous import DistEnv
from ..state import checkpoint, layout
from ..training.parallel.strategy import Strategy, strategy_for
from . import eval_figures, eval_out, eval_results
from .export import adapter, ema, origin, rebuild, safetensors_io
from .export.pipeline import require_trusted
from .export.writer import META
from .load_model import load_model

logger = logging.getLogger("qgtrain")


@trusting_its_flag("--trust-code")  # a model folder's own code (folder_code.py)
def evaluate(
    source: Path,
    env: DistEnv,
    configs: list[Path],
    sets: list[str],
    step: int | None = None,
    every: bool = False,
    trust_code: bool = False,
    out: Path | None = None,
    split: str | None = None,
) -> list[dict[str, Any]]:
    """Score eval.tasks and the splits `split` names (eval_figures.splits_asked) on `source` (a
    run directory's latest checkpoint, step N, or each kept one with `every`; or an export folder);
    the result lines, the new and those already kept. The code a run's config names is imported
    only as export imports it (built in, yours, or `trust_code`). Results and samples go to `out`,
    else the source's own eval/ when it is the user's, else eval_out.default_out."""
    export = (source / META).is_file()
    why = eval_out.whose(source, export)
    cfg, mine, ignored = _config(source, export, configs, sets, why)
    if not export:
        require_trusted(cfg, source, RunDir(source).config, trust_code, what="eval")
    splits = eval_figures.splits_asked(split, bool(cfg.eval.tasks), why is None)
    if not cfg.eval.tasks and not splits:
        theirs = f" (not yours, so its own config's are not read: {why})" if why else ""
        raise QgtrainError(
            f"eval: no eval.tasks to score on {source}{theirs}; name them in a --config file "
            "(see jobs/eval.yaml) or with --set eval.tasks=[...], or score the task's own "
            "figures with --split val"
        )
    # an export's task builds its splits from the export's own config, its code carried inside
    own = eval_figures.export_config(source, sets, trust_code) if export and splits else cfg
    dest = eval_out.destination(source, why, out, mine.logging.runs_dir)
    log.setup_console(env, cfg.logging.level)
    if env.is_main and why is not None:
        unread = f"; the {ignored} eval.tasks of its config are ignored, yours are scored"
        logger.warning(
            "eval: %s is not yours (%s): results go to %s%s",
            source,
            why,
            dest.folder,
            unread if ignored else "",
        )
    device = distributed.pick_device(env, cfg.train.device)
    try:
        with distributed.process_group(
            env, device, cfg.train.startup_timeout_s, cfg.train.collective_timeout_s
        ):
            if export:
                return _evaluate_export(source, cfg, own, env, device, trust_code, dest, splits)
            chosen = _chosen(source, step, every)
            return _evaluate_checkpoints(source, cfg, env, device, chosen, dest, splits)
    finally:
        log.close()


def _config(
    source: Path, export: bool, configs: list[Path], sets: list[str], why: str | None
) -> tuple[RunConfig, RunConfig, int]:
    """The run's own config (an export's: the built-in defaults), the given files and --set on top;
    the user's own (the given ones alone where the run is not theirs: its logging.runs_dir places
    the default --out); and how many eval.tasks of a run not the user's (`why`) were ignored: its
    tasks are the user's alone, since its config could name any file the user can read. Task
    files are read relative to the working directory."""
    given = config_files(configs) if configs else []
    if export:
        mine = load_config(given, sets)
        return mine, mine, 0
    saved = RunDir(source).config
    if not saved.is_file():
        raise QgtrainError(
            f"eval: {source} is neither a run directory (no {layout.CONFIG}) nor an export "
            f"folder (no {META})"
        )
    if why is None:
        cfg = load_config([saved, *given], sets)
        return cfg, cfg, 0
    mine = load_config(given, sets)
    # without its tasks, nor a metric of theirs that early stopping would want reported
    cfg = load_config([saved, *given], [*sets, "eval.tasks=[]", "early_stopping.metric=val_loss"])
    ignored = len(load_config([saved]).eval.tasks)
    tasks = dataclasses.replace(cfg.eval, tasks=mine.eval.tasks)
    return dataclasses.replace(cfg, eval=tasks), mine, ignored


def _chosen(source: Path, step: int | None, every: bool) -> list[checkpoint.Checkpoint]:
    committed = checkpoint.list_committed(RunDir(source).checkpoints)
    if not committed:
        raise QgtrainError(f"eval: {source} holds no committed checkpoint")
    if step is not None:
        chosen = [c for c in committed if c.step == step]
        if not chosen:
            steps = ", ".join(str(c.step) for c in committed)
            raise QgtrainError(
                f"eval: no checkpoint at step {step} in {source}; there are: {steps}"
            )
        return chosen
    return committed if every else committed[-1:]


def _evaluate_checkpoints(
    source: Path,
    cfg: RunConfig,
    env: DistEnv,
    device: torch.device,
    chosen: list[checkpoint.Checkpoint],
    dest: eval_out.Destination,
    splits: list[str],
) -> list[dict[str, Any]]:
    results = dest.folder / "results.jsonl"
    scored_as = eval_figures.scored_as(cfg, splits, eval_results.scored_as(cfg))
    kept = eval_results.kept(results, scored_as, dest.source)
    holder = _holder(cfg, env, device)
    resolved = precision.resolve(cfg.train.precision, holder.device)
    figures = None
    for ckpt in chosen:
        done = {(row["step"], row["task"]) for row in kept}
        left = [name for name in scored_as if (ckpt.step, name) not in done]
        if not left:
            logger.info("eval: step %d already scored on every task as now asked", ckpt.step)
            continue
        problem = checkpoint.verify(ckpt)
        if problem is not None:
            raise QgtrainError(f"eval: {problem}")
        if figures is None and set(left) & set(splits):  # the task's datasets, built once
            figures = eval_figures.Figures(cfg, splits, holder, resolved, ckpt.path)
        module, facts = _checkpoint_model(ckpt, cfg, empty=holder.builds_empty(resuming=False))
        model = _Model(module, holder.wrap(module, False, resolved), facts, holder, resolved)
        where = {"checkpoint": ckpt.path.name, **_source(dest)}
        kept += _score(model, ckpt.step, left, figures, cfg, dest, scored_as, where)
    return kept


def _holder(cfg: RunConfig, env: DistEnv, device: torch.device) -> Strategy:
    """How the ranks hold each checkpoint's model: sharded over them as the run trained it (fsdp,
    hsdp; rank 0 reads the weights and sends each rank its shards, as a training start does), so a
    model too big for one device is scored as the loop scored it; whole on every rank otherwise.
    A LoRA run's base is rebuilt whole (peft puts the adapters on a full model). The run's
    strategy says whether its ranks hold shards: those evaluate in lockstep."""
    trained = strategy_for(cfg.train, env, device)
    if trained.evaluates_in_lockstep and cfg.model.adapter == "none":
        return trained
    return Strategy(cfg.train, env, device)


def _checkpoint_model(
    ckpt: checkpoint.Checkpoint, cfg: RunConfig, empty: bool = False
) -> tuple[nn.Module, dict[str, Any]]:
    """The checkpoint's model on the CPU in fp32 with its weights (the EMA's under
    train.eval_ema), rebuilt as export rebuilds it (a LoRA run's: its base holding the adapters,
    unmerged, as the loop scored it); and its task's facts. `empty`: no weights (the meta
    device), for a rank that will be sent its shards."""
    facts = origin.model_facts(ckpt)
    if cfg.train.eval_ema:
        origin.check_weights(ckpt, "ema")
    if cfg.model.adapter != "none":
        return adapter.trained_model(ckpt, cfg, "ema" if cfg.train.eval_ema else "model"), facts
    model = (
        rebuild.rebuild_lm(ckpt.path, cfg, facts, empty=empty)
        if cfg.task.factory == BUILTIN_LM
        else rebuild.rebuild_model(cfg, facts, empty=empty)  # the task's own model, as trained
    )
    if empty:
        return model, facts
    wanted = safetensors_io.tensors_to_write(model)
    read = safetensors_io.checkpoint_reader(ckpt)
    if cfg.train.eval_ema:
        read = ema.averaged(ckpt, model, read)
    model.load_state_dict(read(wanted), strict=False)  # tied partners are filled through theirs
    return model, facts


def _evaluate_export(
    folder: Path,
    cfg: RunConfig,
    own: RunConfig,
    env: DistEnv,
    device: torch.device,
    trust_code: bool,
    dest: eval_out.Destination,
    splits: list[str],
) -> list[dict[str, Any]]:
    """The export's model scored on eval.tasks (`cfg`), and on the splits of its own task (`own`:
    its own config, eval_figures.export_config)."""
    meta = json.loads((folder / META).read_text())
    if cfg.eval.tasks and not (folder / "tokenizer.json").is_file():
        raise QgtrainError(f"eval: {folder} holds no tokenizer.json to write the tasks' text with")
    module = load_model(folder, trust_code=trust_code)
    facts = {**meta.get("model_facts", {})}
    if cfg.eval.tasks:
        facts.update(tokenizer=str(folder), eos_id=tokenizer.describe(str(folder)).eos_id)
    holder = Strategy(own.train, env, device)
    resolved = precision.resolve(own.train.precision, holder.device)
    figures = eval_figures.Figures(own, splits, holder, resolved, None) if splits else None
    model = _Model(module, holder.wrap(module, False, resolved), facts, holder, resolved)
    scored_as = eval_figures.scored_as(own, splits, eval_results.scored_as(cfg))
    where = {"export": str(folder), **_source(dest)}
    return _score(model, None, list(scored_as), figures, cfg, dest, scored_as, where)


def _source(dest: eval_out.Destination) -> dict[str, str]:
    """What a results line outside the scored folder's own eval/ names: the folder scored."""
    return {"source": dest.source} if dest.source else {}


@dataclasses.dataclass(frozen=True)
class _Model:
    """A model being scored: the module, as its holder holds it (`held`), in `precision`, and its
    task's facts."""

    module: nn.Module
    held: nn.Module
    facts: dict[str, Any]
    holder: Strategy
    precision: str


def _score(
    model: _Model,
    step: int | None,
    names: list[str],
    figures: eval_figures.Figures | None,
    cfg: RunConfig,
    dest: eval_out.Destination,
    scored_as: dict[str, str],
    where: dict[str, Any],
) -> list[dict[str, Any]]:
    """Each split and task of `names` in turn, its line appended (and flushed) by rank 0 as soon as
    it is scored."""
    lines: list[dict[str, Any]] = []
    downstream: Downstream | None = None
    for name in names:
        started = time.perf_counter()
        if figures is not None and name in eval_figures.SPLITS:
            metrics = figures.score(model.module, model.held, name)
        else:
            downstream = downstream or downstream_for(
                cfg, model.held, model.facts, model.holder, model.precision, dest.folder
            )
            if downstream is None:
                raise AssertionError("eval.tasks was checked to be set")
            metrics = downstream.evaluate(step or 0, only={name})
        took = round(time.perf_counter() - started, 3)
        line = {"step": step, **where, "task": name, **metrics, "seconds": took}
        line["scored_as"] = scored_as[name]
        lines.append(line)
        if model.holder.env.is_main:
            with eval_results.appending(dest.folder / "results.jsonl") as out:
                out.write(json.dumps(line) + "\n")
            logger.info("eval %s step %s: %s", name, step, eval_results.figures(metrics))
    return lines
