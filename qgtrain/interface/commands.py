"""What each `qgtrain` command does, given its parsed arguments (cli.py parses them). Each imports
what it needs when it runs, so `qgtrain --help`, `submit --dry-run` and `runs` answer at once on a
login node. Those that write into a run directory (train, recover, and submitting.py's) run under
files.owner_writes_only: nothing they or torch make there is group-writable, whatever the umask."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..config import RunConfig
from ..foundation.errors import ConfigError
from ..foundation.files import owner_writes_only


def load_args_config(args: argparse.Namespace) -> RunConfig:
    from ..config.load import config_files, load_config

    return load_config(config_files(args.config), args.set)


@owner_writes_only()
def train(args: argparse.Namespace) -> int:
    cfg = load_args_config(args)
    from ..run import train
    from ..runtime.rendezvous import from_environ

    return train(cfg, from_environ(os.environ), args.run_dir)


def export(args: argparse.Namespace) -> int:
    from ..ops.export.pipeline import export_run

    done = export_run(
        args.source,
        args.out,
        best=args.best,
        step=args.step,
        force=args.force,
        dtype=args.dtype,
        trust_code=args.trust_code,
        weights=args.weights,
        merge=args.merge,
    )
    how = (
        "tensor by tensor"
        if (diff := done.max_logit_diff) is None
        else f"largest output difference {diff:.3g}"
    )
    print(
        f"exported {done.checkpoint} to {done.folder} in {done.dtype}; reloaded and compared with "
        "the checkpoint, " + how
    )
    return 0


@owner_writes_only()
def evaluate(args: argparse.Namespace) -> int:
    from ..ops import eval_results
    from ..ops import evaluate as scoring
    from ..ops.harness import evaluate_harness
    from ..runtime.rendezvous import from_environ

    if args.harness:
        if args.step is not None or args.all or args.split is not None:
            raise ConfigError(
                "eval --harness scores an export folder on lm-eval's tasks; --step and --all "
                "choose checkpoints, --split the task's own splits"
            )
        tasks = [task.strip() for task in args.harness.split(",") if task.strip()]
        cfg = load_args_config(args)
        lines = evaluate_harness(
            args.source, tasks, args.include_path, cfg, args.out, args.trust_code
        )
        print(eval_results.table(lines))
        return 0
    env = from_environ(os.environ)
    lines = scoring.evaluate(
        args.source,
        env,
        args.config or [],
        args.set,
        args.step,
        args.all,
        args.trust_code,
        args.out,
        args.split,
    )
    if env.is_main:
        print(eval_results.table(lines))
    return 0


@owner_writes_only()
def recover(args: argparse.Namespace) -> int:
    from ..launch import nodes, recovery
    from ..runs.rundir import default_run_dir

    cfg = load_args_config(args)
    decision = recovery.recover(
        (args.run_dir or default_run_dir(cfg)).resolve(),
        args.srun_log,
        args.exit_code,
        args.attempt,
        args.restart,
        args.ranks,
        cfg.slurm,
        nodes.free_nodes(args.partition, cfg.slurm.nodes + args.spare_nodes),
        args.spare_nodes,
        tuple(node for node in args.away.split(",") if node),
        args.step_nodes,
        cfg.train.grad_accum_steps,
    )
    print(f"qgtrain: the step failed (exit {args.exit_code}): {decision.reason}", file=sys.stderr)
    print(decision.line())
    return 0


def runs(args: argparse.Namespace) -> int:
    from ..foundation.terminal import shown
    from ..launch.stages import chains
    from ..launch.sweep import swept_values
    from ..ops.runs import as_json, as_table, find_runs, summarize

    folder = args.folder or Path(load_args_config(args).logging.runs_dir)
    swept = swept_values(folder)
    rows = [summarize(run, swept.get(run.name, {})) for run in find_runs(folder)]
    print(as_json(rows) if args.json else (as_table(rows) if rows else f"no runs in {folder}"))
    if not args.json and (stages := chains(folder)):
        print("\n".join(map(shown, stages)))
    return 0


def plot(args: argparse.Namespace) -> int:
    from ..ops.plot import plot_runs

    out = plot_runs(args.runs, args.out, [m.strip() for m in args.metric.split(",") if m.strip()])
    print(f"wrote {out}")
    return 0


def doctor(args: argparse.Namespace) -> int:
    from ..ops.doctor import exit_code, render, run_checks
    from ..runtime.rendezvous import from_environ

    cfg, env = load_args_config(args), from_environ(os.environ)
    checks = run_checks(cfg, env, os.environ, collective=args.collective)
    if env.is_main:
        print(render(checks, env))
    return exit_code(checks)


def data_prepare(args: argparse.Namespace) -> int:
    from ..config.model import with_pretrained_tokenizer
    from ..data.cache.prepare import held_out_files, mixed_sources, prepare_configured
    from ..runtime.log import setup_console
    from ..runtime.rendezvous import DistEnv

    cfg = with_pretrained_tokenizer(load_args_config(args))  # as train tokenizes
    setup_console(DistEnv(), cfg.logging.level)
    targets = [(f" (data.mix source {name})", data) for name, data in mixed_sources(cfg.data)]
    targets += [(f" (data.{split}_files)", data) for split, data in held_out_files(cfg.data)]
    for source, data in targets or [("", cfg.data)]:
        files, made = prepare_configured(data, args.workers, cfg.logging.shared)
        counts = ", ".join(f"{split} {count:,}" for split, count in files.tokens.items())
        print(
            f"{'prepared' if made else 'already prepared, reused'} {files.folder}: tokens "
            f"{counts}{source}"
        )
    return 0


def data_info(args: argparse.Namespace) -> int:
    from ..ops.data_info import configured, describe, render

    data = None if args.path else load_args_config(args).data
    folder = args.path or Path(data.cache_dir if data else ".")
    entries = describe(folder) if args.path or folder.exists() else []  # none made yet
    if args.json:
        print(json.dumps(entries, indent=1))
        return 0
    print("\n".join([*(configured(data) if data else []), render(entries)]))
    return 0


def config(args: argparse.Namespace) -> int:
    from ..config.load import config_to_dict, dump_yaml
    from ..foundation.errors import ConfigError

    cfg = load_args_config(args)
    if args.get is None:
        sys.stdout.write(dump_yaml(cfg))
        return 0
    section, _, key = args.get.partition(".")
    values = config_to_dict(cfg)
    if section not in values or key not in values[section]:
        raise ConfigError(f"--get {args.get}: no such key; `qgtrain config` lists them all")
    value = values[section][key]
    print(json.dumps(value) if isinstance(value, (list, bool)) or value is None else value)
    return 0


def env(args: argparse.Namespace) -> int:
    from ..runtime import devices, rendezvous

    print(devices.report(rendezvous.from_environ(os.environ), load_args_config(args).train.device))
    return 0
