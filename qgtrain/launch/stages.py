"""Stages: `qgtrain submit --then FILE ...`, jobs that follow each other, each when the one before
finished.

Slurm's `--dependency=afterok` is not used: a requeued job's dependents wait on a job that keeps
coming back, and a dependency on a job that failed is never satisfied. Instead every stage is
planned and checked at submit (all configs, all scripts), and the job whose training finished
submits the next stage from its batch shell, after its last training step (`qgtrain next-stage`): a
requeue, a retried step or a preemption never gets there, since only a finished run does. A last
stage whose file holds only an eval: section is an evaluation: `qgtrain eval` on every kept
checkpoint of the stage before, with that stage's config and the file's tasks. The
submission is claimed by creating `<first run dir>/stages/<n>.submitted` exclusively (O_EXCL) before
sbatch, so it happens at most once whatever ran before; a stage that failed writes
`<n>.not-submitted` with the reason instead. No torch here.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..config import RunConfig
from ..config.load import config_to_dict, dump_yaml, load_config, with_overrides
from ..config.slurm import runs_from_snapshot
from ..foundation.errors import ConfigError
from ..foundation.files import write_atomic
from ..runs import rundir
from ..runs.rundir import RunDir, default_run_dir
from .runfrom import job_config, shell_lines, snapshot
from .sbatch import Runner, SubmissionError, render, submit, submit_config
from .submit_host import submitting_python

CHAIN = "chain.json"
# early stopping ends training as planned: the next stage follows
FINISHED = ("finished", "stopped early")


@dataclass(frozen=True)
class Stage:
    index: int  # 1 for the first stage
    source: str  # what made it: the first stage's config, or its --then file
    cfg: RunConfig
    evaluates: bool = False  # `qgtrain eval` on the stage before's run, not a training run


def plan(first: RunConfig, files: list[Path]) -> list[Stage]:
    """Every stage's config, checked before anything is submitted: stage n is the first stage's
    config with the n-th --then file on top, in a run directory of its own (`<run name>-stage<n>`
    unless the file names one)."""
    stages = [Stage(1, "the first stage's config", first)]
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "first-stage.yaml"
        base.write_text(dump_yaml(first))
        for index, file in enumerate(files, start=2):
            stage = Stage(index, str(file), _stage_config(first, base, file, index))
            stages.append(_as_evaluation(stage, stages[-1], Path(tmp)) or stage)
    _evaluation_last(stages)
    names = [s.cfg.train.run_name for s in stages if not s.evaluates]
    if len(set(names)) != len(names):
        raise ConfigError(
            f"--then: two stages would share a run directory ({names}); give each "
            "its own train.run_name, or none (stage n is then <run name>-stage<n>)"
        )
    for before, stage in zip(stages, stages[1:]):
        _check_weights(before, stage)
    return stages


def _as_evaluation(stage: Stage, before: Stage, tmp: Path) -> Stage | None:
    """A stage whose file holds only an eval: section scores the stage before (its config, the
    file's tasks) instead of training; None for any other."""
    raw = yaml.safe_load(Path(stage.source).read_text())
    if not isinstance(raw, dict) or set(raw) != {"eval"}:
        return None
    base = tmp / f"stage-{before.index}.yaml"
    base.write_text(dump_yaml(before.cfg))
    cfg = load_config([base, Path(stage.source)])
    if not cfg.eval.tasks:
        raise ConfigError(
            f"--then {stage.source}: an evaluation stage (a file with only an eval: section) "
            "needs eval.tasks to score"
        )
    return Stage(stage.index, stage.source, cfg, evaluates=True)


def _evaluation_last(stages: list[Stage]) -> None:
    for stage in stages[:-1]:
        if stage.evaluates:
            raise ConfigError(
                f"--then {stage.source}: holds only an eval: section, which makes it an "
                "evaluation stage, and an evaluation ends a chain; put it last"
            )


def _stage_config(first: RunConfig, base: Path, file: Path, index: int) -> RunConfig:
    if not file.is_file():
        raise ConfigError(
            f"--then {file}: no such file; give a YAML file that sets what stage {index} changes"
        )
    try:
        cfg = load_config([base, file])
    except ConfigError as exc:
        said = str(exc).replace(f"{base}, ", "").replace(str(base), "the first stage's config")
        raise ConfigError(f"--then {file}: {said}") from None
    if config_to_dict(cfg) == config_to_dict(first):
        raise ConfigError(
            f"--then {file}: changes nothing in the first stage's config; a stage's "
            "file sets what that stage does differently (data, optim.lr, "
            "model.pretrained, ...)"
        )
    if cfg.train.run_name == first.train.run_name:
        cfg = with_overrides(cfg, [f"train.run_name={first.train.run_name}-stage{index}"])
    return cfg


def export_dir(cfg: RunConfig) -> Path:
    if cfg.export.dir:
        return Path(cfg.export.dir).resolve()
    return RunDir(default_run_dir(cfg).resolve()).export


def _check_weights(before: Stage, stage: Stage) -> None:
    """A stage that starts from the previous stage's export needs that stage to export when it
    finishes."""
    pretrained = stage.cfg.model.pretrained
    from_export = pretrained and Path(pretrained).resolve() == export_dir(before.cfg)
    if from_export and not before.cfg.export.on_finish:
        raise ConfigError(
            f"--then {stage.source}: model.pretrained is stage {before.index}'s "
            f"export ({pretrained}), which it never writes; set export.on_finish: "
            f"true for stage {before.index}"
        )


def epilogue(folder: Path, index: int, chain_id: str) -> str:
    """The batch script's lines after training: hand the outcome to `qgtrain next-stage`, in a shell
    without this job's Slurm variables (srun in the next job would read its SLURM_CPUS_PER_TASK,
    ...): the next job is submitted as if from the submit directory by hand."""
    quoted = str(folder).replace("'", "'\\''")
    return (
        "(  # the next stage, if this one finished\n"
        '    claimed_by="${SLURM_JOB_ID:-}"\n'
        '    for name in "${!SLURM_@}" "${!SBATCH_@}" "${!SRUN_@}"; do\n'
        '        [ "$name" = SLURM_CONF ] || unset "$name"\n'
        "    done\n"
        f"    \"$RECOVER_PYTHON\" -m qgtrain next-stage '{quoted}' --after {index} "
        f'--exit-code "$status" --job "$claimed_by" --chain-id {chain_id}\n'
        ") || true\n"
    )


def submit_chain(
    stages: list[Stage], submit_dir: Path, run: Runner = subprocess.run
) -> tuple[str, Path]:
    """Write every later stage's config and script into `<first run dir>/stages/`, then submit the
    first stage; returns its job id and the chain's folder. One code snapshot serves every stage."""
    first = stages[0].cfg
    first_dir = default_run_dir(first).resolve()
    rundir.require_safe(first_dir)  # before the snapshot: nothing is written into a foreign run
    taken = runs_from_snapshot(first.slurm)
    code = snapshot(first, submit_dir, RunDir(first_dir).code) if taken else None
    folder, chain_id = RunDir(first_dir).stages, uuid.uuid4().hex[:8]
    rundir.create(first_dir, first.logging.shared)
    folder.mkdir(mode=rundir.folder_mode(first.logging.shared), exist_ok=True)
    _set_aside(folder)
    for stage in stages[1:]:
        cfg = job_config(stage.cfg, submit_dir, code) if code else stage.cfg
        config = folder / f"stage-{stage.index}.yaml"
        write_atomic(config, dump_yaml(cfg))
        after = epilogue(folder, stage.index, chain_id) if stage.index < len(stages) else ""
        evaluated = shlex.quote(str(default_run_dir(stage.cfg).resolve()))
        write_atomic(
            folder / f"stage-{stage.index}.sbatch",
            render(
                cfg.slurm,
                str(config),
                code=shell_lines(code) if code else None,
                after=after,
                command=f"eval {evaluated} --all" if stage.evaluates else "train",
                python=submitting_python(),
            ),
        )
    record = {
        "id": chain_id,
        "submit_dir": str(submit_dir.resolve()),
        "created": time.time(),
        "stages": [
            {
                "stage": s.index,
                "source": s.source,
                "run_name": s.cfg.train.run_name,
                "run_dir": str(default_run_dir(s.cfg).resolve()),
                "evaluates": s.evaluates,
            }
            for s in stages
        ],
    }
    write_atomic(folder / CHAIN, json.dumps(record, indent=1))
    job_id = submit_config(
        first, RunDir(first_dir).slurm, run, after=epilogue(folder, 1, chain_id), code=code
    )
    write_atomic(folder / "1.submitted", json.dumps({"job_id": job_id, "time": time.time()}))
    return job_id, folder


def _set_aside(folder: Path) -> None:
    """An earlier chain of the same first run, submitted again: its records go to earlier/<its id>/,
    and its jobs still queued find their chain replaced (next_stage) instead of submitting this
    one's stages."""
    earlier = _read(folder / CHAIN)
    if earlier is None:
        return
    kept = folder / "earlier" / str(earlier.get("id", "unknown"))
    for made in (kept.parent, kept):  # no wider than stages/ lets anyone in, whatever the umask
        made.mkdir(mode=0o750, exist_ok=True)
    for entry in folder.iterdir():
        if entry.name != "earlier":
            entry.rename(kept / entry.name)


def next_stage(
    folder: Path,
    index: int,
    exit_code: int,
    job: str = "",
    chain_id: str = "",
    run: Runner = subprocess.run,
) -> str:
    """After stage `index`'s last training step: submit the next stage if its training finished,
    record why not if it failed for good, wait (do nothing) if it was requeued. Returns what to
    print. The chain's folder is checked first: its scripts, and chain.json's submit_dir (whose
    .venv/bin/python a stage runs), are run as the user."""
    rundir.require_safe(folder.parent)
    chain = json.loads((folder / CHAIN).read_text())
    if chain_id and chain.get("id") != chain_id:
        return (
            f"this job's chain {chain_id} was replaced by chain {chain.get('id')}; "
            "nothing submitted"
        )
    stages = chain["stages"]
    if index >= len(stages):
        return f"stage {index} was the chain's last"
    status = rundir.read_status(Path(stages[index - 1]["run_dir"]))
    state = str(status.get("status", "unknown"))
    if exit_code == 0 and state in FINISHED:
        return _submit_once(folder, index + 1, Path(chain["submit_dir"]), job, run)
    reason = why_not(index, exit_code, status)
    if reason is None:
        return f"stage {index} goes on after its requeue; stage {index + 1} waits for it"
    _record(folder / f"{index + 1}.not-submitted", reason)
    return f"stage {index + 1} not submitted: {reason}"


def why_not(index: int, exit_code: int, status: dict[str, object]) -> str | None:
    """Why stage `index` will never finish in this job, or None when it was requeued and goes on."""
    state, error = str(status.get("status", "unknown")), status.get("error")
    if exit_code in (75, 76):  # stopped at a checkpoint: requeued by rank 0 or by the batch shell
        if status.get("requeued") is False:
            return (
                f"stage {index} stopped at a checkpoint and was not requeued "
                "(slurm.max_restarts or scancel)"
            )
        return None
    failures = status.get("failures")
    last = failures[-1] if isinstance(failures, list) and failures else {}
    if isinstance(last, dict) and str(last.get("action", "")).startswith("requeue"):
        return None
    said = f": {error}" if error else ""
    return f"stage {index} ended with exit {exit_code} ({state}{said})"


def _submit_once(folder: Path, index: int, submit_dir: Path, job: str, run: Runner) -> str:
    claim = folder / f"{index}.submitted"
    try:
        fd = os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return f"stage {index} was submitted before: {claim.read_text().strip()}"
    with os.fdopen(fd, "w") as out:
        out.write(json.dumps({"job_id": None, "claimed_by": job, "time": time.time()}))
    try:
        job_id = submit(folder / f"stage-{index}.sbatch", functools.partial(run, cwd=submit_dir))
    except SubmissionError as exc:
        _record(folder / f"{index}.not-submitted", str(exc))
        return f"stage {index} not submitted: {exc}"
    write_atomic(claim, json.dumps({"job_id": job_id, "claimed_by": job, "time": time.time()}))
    return f"submitted stage {index} as job {job_id}"


def describe(folder: Path) -> list[str]:
    """Where a chain stands, one line per stage, for `qgtrain runs`."""
    chain = json.loads((folder / CHAIN).read_text())
    lines = []
    for stage in chain["stages"]:
        index, run = stage["stage"], Path(stage["run_dir"])
        submitted = _read(folder / f"{index}.submitted")
        refused = _read(folder / f"{index}.not-submitted")
        if refused:
            where = f"not submitted: {refused.get('reason')}"
        elif submitted and submitted.get("job_id") is None:
            where = (
                f"claimed by job {submitted.get('claimed_by')} but never confirmed (that "
                "job ended before sbatch answered): see squeue, or submit it by hand: cd "
                f"{chain['submit_dir']} && sbatch {folder / f'stage-{index}.sbatch'}"
            )
        elif submitted and stage.get("evaluates"):
            results = RunDir(run).eval / "results.jsonl"
            lines_in = len(results.read_text().splitlines()) if results.is_file() else 0
            where = f"job {submitted.get('job_id')}: {lines_in} result(s) in {results}"
        elif submitted:
            state = rundir.read_status(run).get("status", "queued")
            where = f"job {submitted.get('job_id')}: {state}"
        else:
            where = "waits for the stage before"
        lines.append(f"stage {index}/{len(chain['stages'])} {stage['run_name']}: {where}")
    return lines


def chains(root: Path) -> list[str]:
    """Where each chain of stages under root stands, one line per stage (`qgtrain runs`)."""
    lines = []
    for chain in sorted(root.glob(f"*/stages/{CHAIN}")):
        name = chain.parent.parent.name
        try:
            lines += [f"chain {name}: {line}" for line in describe(chain.parent)]
        except (OSError, ValueError, KeyError, TypeError):
            lines.append(f"chain {name}: {chain} cannot be read")
    return lines


def _record(path: Path, reason: str) -> None:
    write_atomic(path, json.dumps({"reason": reason, "time": time.time()}))


def _read(path: Path) -> dict[str, object] | None:
    try:
        found = json.loads(path.read_text())
        return found if isinstance(found, dict) else None
    except (OSError, ValueError):
        return None
