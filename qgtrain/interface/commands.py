"""What each `qgtrain` command does, given its parsed arguments (cli.py parses them). Each imports
what it needs when it runs, so `qgtrain --help`, `submit --dry-run` and `runs` answer at once on a
login node."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..config import RunConfig


def load_args_config(args: argparse.Namespace) -> RunConfig:
    from ..config.load import config_files, load_config

    return load_config(config_files(args.config), args.set)


def train(args: argparse.Namespace) -> int:
    cfg = load_args_config(args)
    from ..run import train
    from ..runtime.rendezvous import from_environ

    return train(cfg, from_environ(os.environ), args.run_dir)


def submit(args: argparse.Namespace) -> int:
    from ..launch.sbatch import render, submit_config
    from ..launch.slurm_checks import validate
    from ..state.rundir import RunDir, default_run_dir

    cfg = load_args_config(args)
    validate(cfg.slurm)
    if args.then:
        return submit_stages(args, cfg)
    if args.sweep or args.max_parallel is not None:
        return submit_array(args, cfg)
    run_dir = default_run_dir(cfg).resolve()
    job_dir = RunDir(run_dir).slurm
    if args.launcher == "submitit":
        if args.dry_run:
            from ..launch.submitit_params import dry_run_parameters

            print(json.dumps(dry_run_parameters(cfg), indent=1))
            return 0
        from ..launch.submitit_launcher import submit as submit_python

        job = submit_python(cfg)
        print(
            f"submitted job {job.job_id} (submitit); logs in {job.paths.folder}; run directory "
            f"{run_dir}"
        )
        return 0
    if args.dry_run:
        code = _planned_code(cfg, run_dir)
        sys.stdout.write(render(cfg.slurm, str(job_dir / "config.yaml"), code=code))
        return 0
    job_id = submit_config(cfg, job_dir)
    print(
        f"submitted job {job_id}; output in "
        f"{Path(cfg.slurm.output_dir).resolve()}/{cfg.slurm.job_name}-{job_id}.out; run directory "
        f"{run_dir}{_code_note(run_dir)}"
    )
    return 0


def _planned_code(cfg: RunConfig, run_dir: Path) -> str | None:
    """The lines that would move the job into its snapshot (its size checked, nothing copied)."""
    from ..launch.runfrom import planned, shell_lines
    from ..launch.sbatch import snapshots
    from ..state.rundir import RunDir

    if not snapshots(cfg.slurm):
        return None
    return shell_lines(planned(cfg, Path.cwd(), RunDir(run_dir).code))


def _code_note(run_dir: Path) -> str:
    from ..launch.sbatch import code_of
    from ..state.rundir import RunDir

    code = code_of(RunDir(run_dir).slurm / "job.sbatch")
    return f"; code snapshot {code}" if code else ""


def submit_stages(args: argparse.Namespace, cfg: RunConfig) -> int:
    from ..foundation.errors import ConfigError
    from ..launch import stages
    from ..state.rundir import RunDir, default_run_dir

    if args.sweep or args.max_parallel is not None or args.launcher != "sbatch":
        raise ConfigError(
            "--then: stages are submitted with the sbatch launcher, one run per "
            "stage; leave out --sweep, --max-parallel and --launcher submitit"
        )
    planned = stages.plan(cfg, args.then)
    if args.dry_run:
        run_dir = default_run_dir(cfg).resolve()
        from ..launch.sbatch import render

        sys.stdout.write(
            render(
                cfg.slurm,
                str(RunDir(run_dir).slurm / "config.yaml"),
                code=_planned_code(cfg, run_dir),
                after=stages.epilogue(RunDir(run_dir).stages, 1, "CHAIN-ID"),
            )
        )
        sys.stdout.write(
            "".join(
                f"# stage {s.index}: run {s.cfg.train.run_name} from {s.source}\n" for s in planned
            )
        )
        return 0
    job_id, folder = stages.submit_chain(planned, Path.cwd())
    names = ", ".join(s.cfg.train.run_name for s in planned)
    print(
        f"submitted stage 1 of {len(planned)} as job {job_id}; each next stage is submitted "
        f"when the one before finishes; runs {names}; chain in {folder}"
        f"{_code_note(folder.parent)}"
    )
    return 0


def snapshot(args: argparse.Namespace) -> int:
    from ..launch.runfrom import for_attempt

    found = for_attempt(load_args_config(args), args.job, Path.cwd())
    if found:
        code, config = found
        print(f"{code.workdir}\n{code.pythonpath}\n{config}")
    return 0


def next_stage(args: argparse.Namespace) -> int:
    from ..launch.stages import next_stage as after_stage

    said = after_stage(args.chain, args.after, args.exit_code, args.job, args.chain_id)
    print(f"qgtrain: {said}", file=sys.stderr)
    return 0


def submit_array(args: argparse.Namespace, cfg: RunConfig) -> int:
    from ..foundation.errors import ConfigError
    from ..launch import sweep

    if not args.sweep:
        raise ConfigError("--max-parallel: only with --sweep")
    axes = sweep.parse(args.sweep)
    if not args.dry_run:
        sweep.check_size(sweep.combinations(axes))
    planned = sweep.expand(cfg, axes)
    if args.launcher == "sbatch" or args.dry_run:
        sys.stdout.write(
            sweep.submit_array(
                planned, args.max_parallel, dry_run=args.dry_run, launcher=args.launcher
            )
        )
        return 0
    from ..launch.submitit_launcher import submit_sweep

    jobs = submit_sweep(cfg, planned, max_parallel=args.max_parallel)
    print(
        f"submitted job array {jobs[0].job_id.split('_')[0]} (submitit) with {len(jobs)} tasks; "
        f"runs in {Path(cfg.logging.runs_dir).resolve()}"
    )
    return 0


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


def recover(args: argparse.Namespace) -> int:
    from ..launch import nodes, recovery
    from ..state.rundir import default_run_dir

    cfg = load_args_config(args)
    decision = recovery.recover(
        (args.run_dir or default_run_dir(cfg)).resolve(),
        args.srun_log,
        args.exit_code,
        args.attempt,
        args.restart,
        args.ranks,
        cfg.slurm,
        nodes.spare_nodes(args.partition, cfg.slurm.nodes),
    )
    print(f"qgtrain: the step failed (exit {args.exit_code}): {decision.reason}", file=sys.stderr)
    print(decision.line())
    return 0


def runs(args: argparse.Namespace) -> int:
    from ..launch.stages import chains
    from ..launch.sweep import swept_values
    from ..ops.runs import as_json, as_table, find_runs, shown, summarize

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
    from ..data.prepare import mixed_sources, prepare_configured
    from ..runtime.log import setup_console
    from ..runtime.rendezvous import DistEnv

    cfg = load_args_config(args)
    setup_console(DistEnv(), cfg.logging.level)
    targets = [(f" (data.mix source {name})", data) for name, data in mixed_sources(cfg.data)]
    for source, data in targets or [("", cfg.data)]:
        files, made = prepare_configured(data, args.workers)
        counts = ", ".join(f"{split} {count:,}" for split, count in files.tokens.items())
        print(
            f"{'prepared' if made else 'already prepared, reused'} {files.folder}: tokens "
            f"{counts}{source}"
        )
    return 0


def data_info(args: argparse.Namespace) -> int:
    from ..ops.data_info import describe, render

    entries = describe(args.path or Path(load_args_config(args).data.cache_dir))
    print(json.dumps(entries, indent=1) if args.json else render(entries))
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
