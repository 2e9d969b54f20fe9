"""The commands that put a run on the cluster: `qgtrain submit` (one job, an array of a sweep, or a
chain of stages), and the two a job's batch shell calls itself (`snapshot`, `next-stage`). Kept
apart from the commands that run here and now (commands.py); like them, each imports what it needs
when it runs, so `submit --dry-run` answers at once on a login node."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import RunConfig
from ..foundation.files import owner_writes_only
from .commands import load_args_config


@owner_writes_only()
def submit(args: argparse.Namespace) -> int:
    from ..launch.sbatch import render, submit_config
    from ..launch.slurm_checks import validate
    from ..launch.submit_host import require_slurm, submitting_python
    from ..runs.rundir import RunDir, default_run_dir

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
        python = submitting_python()
        sys.stdout.write(render(cfg.slurm, str(job_dir / "config.yaml"), code=code, python=python))
        return 0
    require_slurm("sbatch")
    job_id = submit_config(cfg, job_dir)
    print(
        f"submitted job {job_id}; output in "
        f"{Path(cfg.slurm.output_dir).resolve()}/{cfg.slurm.job_name}-{job_id}.out; run directory "
        f"{run_dir}{_code_note(run_dir)}"
    )
    return 0


def _planned_code(cfg: RunConfig, run_dir: Path) -> str | None:
    """The lines that would move the job into its snapshot (its size checked, nothing copied)."""
    from ..config.slurm import runs_from_snapshot
    from ..launch.runfrom import planned, shell_lines
    from ..runs.rundir import RunDir

    if not runs_from_snapshot(cfg.slurm):
        return None
    return shell_lines(planned(cfg, Path.cwd(), RunDir(run_dir).code))


def _code_note(run_dir: Path) -> str:
    from ..launch.runfrom import code_of
    from ..runs.rundir import RunDir

    code = code_of(RunDir(run_dir).slurm / "job.sbatch")
    return f"; code snapshot {code}" if code else ""


def submit_stages(args: argparse.Namespace, cfg: RunConfig) -> int:
    from ..foundation.errors import ConfigError
    from ..launch import stages
    from ..launch.submit_host import require_slurm, submitting_python
    from ..runs.rundir import RunDir, default_run_dir

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
                python=submitting_python(),
            )
        )
        sys.stdout.write(
            "".join(
                f"# stage {s.index}: {'evaluate' if s.evaluates else 'run'} "
                f"{s.cfg.train.run_name} from {s.source}\n"
                for s in planned
            )
        )
        return 0
    require_slurm("sbatch")
    job_id, folder = stages.submit_chain(planned, Path.cwd())
    names = ", ".join(s.cfg.train.run_name for s in planned if not s.evaluates)
    names += " (then evaluated)" if planned[-1].evaluates else ""
    print(
        f"submitted stage 1 of {len(planned)} as job {job_id}; each next stage is submitted "
        f"when the one before finishes; runs {names}; chain in {folder}"
        f"{_code_note(folder.parent)}"
    )
    return 0


@owner_writes_only()
def snapshot(args: argparse.Namespace) -> int:
    from ..launch.runfrom import for_attempt, verified

    if args.verify:
        verified(args.verify.absolute())
        return 0
    found = for_attempt(load_args_config(args), args.job, Path.cwd())
    if found:
        code, config = found
        print(f"{code.workdir}\n{code.pythonpath}\n{config}")
    return 0


@owner_writes_only()
def next_stage(args: argparse.Namespace) -> int:
    from ..launch.stages import next_stage as after_stage

    said = after_stage(args.chain, args.after, args.exit_code, args.job, args.chain_id)
    print(f"qgtrain: {said}", file=sys.stderr)
    return 0


def submit_array(args: argparse.Namespace, cfg: RunConfig) -> int:
    from ..foundation.errors import ConfigError
    from ..launch import sweep
    from ..launch.submit_host import require_slurm

    if not args.sweep:
        raise ConfigError("--max-parallel: only with --sweep")
    axes = sweep.parse(args.sweep)
    if not args.dry_run:
        sweep.check_size(sweep.combinations(axes))
    planned = sweep.expand(cfg, axes)
    if args.launcher == "sbatch" and not args.dry_run:
        require_slurm("sbatch")
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
