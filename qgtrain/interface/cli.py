"""The `qgtrain` command. Subcommands import their modules when they run, so `--help`, `config` and
`submit` answer at once on a login node: nothing here imports torch or transformers at start-up.

A QgtrainError becomes one line on stderr and its exit code; `--debug` shows the traceback instead.
The line is escaped (foundation/terminal.py): it may quote what others wrote (a task file's line,
a file's name in a shared folder), and stays one line that cannot drive the terminal.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..foundation.errors import EXIT_USAGE, QgtrainError
from ..foundation.terminal import shown
from ..foundation.version import __version__
from . import collector, commands, submitting


def main(argv: list[str] | None = None) -> int:
    collector.quiet_for_a_command()
    parser = _parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args) or 0)
    except QgtrainError as exc:
        if args.debug:
            raise
        print(f"qgtrain: error: {shown(str(exc))}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qgtrain",
        description="PyTorch DDP training on Slurm clusters that "
        "survives time limits and preemption.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    parser.add_argument("--version", action="version", version=f"qgtrain {__version__}")
    sub = parser.add_subparsers(metavar="COMMAND")
    _training_commands(sub)
    _job_commands(sub)
    _operations_commands(sub)
    return parser


def _training_commands(sub: Any) -> None:
    """train, submit, export: what a run is for."""
    train = sub.add_parser("train", help="train (1 process, or one rank per srun/torchrun task)")
    _config_args(train)
    train.add_argument(
        "--run-dir", type=Path, help="run directory (default: <logging.runs_dir>/<train.run_name>)"
    )
    train.set_defaults(func=commands.train)

    submit = sub.add_parser("submit", help="submit training to Slurm (sbatch or submitit)")
    _config_args(submit)
    submit.add_argument(
        "--launcher",
        choices=("sbatch", "submitit"),
        default="sbatch",
        help="sbatch: the rendered train.slurm (default); submitit: a Python job",
    )
    submit.add_argument(
        "--dry-run", action="store_true", help="print the batch script; submit nothing"
    )
    submit.add_argument(
        "--sweep",
        action="append",
        default=[],
        metavar="KEY=V1,V2",
        help="one job array, a task per combination of the swept values (repeat for more keys)",
    )
    submit.add_argument(
        "--max-parallel", type=int, metavar="K", help="with --sweep: at most K tasks at once"
    )
    submit.add_argument(
        "--then",
        action="append",
        default=[],
        type=Path,
        metavar="FILE",
        help="a next stage: the first stage's config with FILE on top, "
        "submitted when the stage before finishes (repeat for more stages)",
    )
    submit.set_defaults(func=submitting.submit)
    _export_command(sub)
    _eval_command(sub)
    _recover_command(sub)


def _eval_command(sub: Any) -> None:
    evaluate = sub.add_parser(
        "eval",
        help="score a run's checkpoints or an export: the task's own loss and metrics on its "
        "splits, and the downstream tasks of eval.tasks (1 process, or one rank per "
        "srun/torchrun task)",
    )
    evaluate.add_argument(
        "source", type=Path, help="a run directory (its latest checkpoint) or an export folder"
    )
    which = evaluate.add_mutually_exclusive_group()
    which.add_argument("--step", type=int, help="the checkpoint of step N")
    which.add_argument(
        "--all",
        action="store_true",
        help="every kept checkpoint, each once (a killed eval started again goes on)",
    )
    evaluate.add_argument(
        "--split",
        metavar="val[,test]",
        help="score the task's own loss and Task.metrics on these splits, over the whole split "
        "(val_loss, val_<metric>, test_...: the loop's figures). Default: val when there are no "
        "eval.tasks to score on a run or export of yours, else none; test only when asked (the "
        "loop reports it once, at the end: choosing checkpoints by it spoils it)",
    )
    _config_args(evaluate, "a config file on top of the run's own (an export's: the defaults)")
    evaluate.add_argument(
        "--harness",
        metavar="TASK[,TASK]",
        help="an export: lm-evaluation-harness's tasks instead (pip install 'qgtrain[eval]')",
    )
    evaluate.add_argument(
        "--include-path", type=Path, metavar="DIR", help="--harness: a folder of local task YAMLs"
    )
    evaluate.add_argument(
        "--trust-code",
        action="store_true",
        help="import the factories the run's config names even if the run is not yours (an "
        "export's task code: always), run a model folder's own code (auto_map) and "
        "--include-path's task code (!function), from folders of yours that no one else can "
        "write; read that code first",
    )
    evaluate.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="a folder of yours for results.jsonl and samples (default: the run's or export's "
        "eval/ if it is yours, else <logging.runs_dir>/eval-of-<its name>, logging.runs_dir of "
        "your --config/--set; a run not yours is scored on your eval.tasks only)",
    )
    evaluate.set_defaults(func=commands.evaluate)


def _export_command(sub: Any) -> None:
    export = sub.add_parser(
        "export",
        help="write a checkpoint's model to a folder: safetensors weights, "
        "what rebuilds it, a model card (Hugging Face format where it is one)",
    )
    export.add_argument(
        "source", type=Path, help="a run directory (its latest checkpoint) or a checkpoint folder"
    )
    export.add_argument(
        "--out", type=Path, required=True, help="the folder to write (must be empty)"
    )
    which = export.add_mutually_exclusive_group()
    which.add_argument(
        "--best",
        nargs="?",
        const=True,
        default=False,
        metavar="METRIC",
        help="the best checkpoint by early_stopping.metric, or by METRIC (val_loss, "
        "eval_<task>_acc, ...: lowest for a loss or ppl, else highest)",
    )
    which.add_argument("--step", type=int, help="the checkpoint of step N")
    export.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier export in --out (never other files)",
    )
    export.add_argument(
        "--dtype",
        choices=["auto", "bf16", "fp32"],
        help="the weights' dtype (default: export.dtype)",
    )
    export.add_argument(
        "--weights",
        choices=["model", "ema"],
        default="model",
        help="model: the trained weights (default); ema: their EMA (train.ema_decay)",
    )
    export.add_argument(
        "--merge",
        action="store_true",
        help="a LoRA run: write the model with its adapters merged in, loadable by "
        "transformers alone (default: the PEFT adapter folder)",
    )
    export.add_argument(
        "--trust-code",
        action="store_true",
        help="import the factories the run's config names even if the run is not "
        "yours (owned by you, writable by no one else), and run a model folder's own code "
        "(auto_map) from a folder of yours that no one else can write; read that code first",
    )
    export.set_defaults(func=commands.export)


def _recover_command(sub: Any) -> None:
    recover = sub.add_parser(
        "recover", help="(train.slurm, after a failed step) print retry, requeue or end"
    )
    _config_args(recover)
    recover.add_argument("--exit-code", type=int, required=True, help="srun's exit status")
    recover.add_argument(
        "--attempt", type=int, required=True, help="retries made in this allocation so far"
    )
    recover.add_argument(
        "--srun-log", type=Path, required=True, help="what srun wrote to its stderr"
    )
    recover.add_argument("--restart", type=int, default=0, help="SLURM_RESTART_COUNT")
    recover.add_argument("--ranks", type=int, required=True, help="the failed step's ranks")
    recover.add_argument(
        "--step-nodes", type=int, default=0, help="the failed step's nodes (0 = slurm.nodes)"
    )
    recover.add_argument("--partition", default="", help="SLURM_JOB_PARTITION")
    recover.add_argument(
        "--spare-nodes", type=int, default=0, help="the allocation's spare nodes (as rendered)"
    )
    recover.add_argument(
        "--away", default="", help="nodes earlier retries left out, comma-separated"
    )
    recover.add_argument("--run-dir", type=Path, help="the run directory (default: the config's)")
    recover.set_defaults(func=commands.recover)


def _job_commands(sub: Any) -> None:
    """snapshot, next-stage: what a batch script runs around training (no torch)."""
    snap = sub.add_parser(
        "snapshot",
        help="(train.slurm, at each start) take the job's code "
        "snapshot once; print its folder, PYTHONPATH and config",
    )
    _config_args(snap)
    snap.add_argument("--job", default="", help="the Slurm job id (array jobs: <id>_<task>)")
    snap.add_argument(
        "--verify",
        type=Path,
        metavar="DIR",
        help="(a submitted job, at each start) only check that the snapshot DIR is yours alone "
        "and unchanged; exit 2 if not",
    )
    snap.set_defaults(func=submitting.snapshot)

    after = sub.add_parser(
        "next-stage",
        help="(a stage's batch script, after training) submit "
        "the next stage if this one finished, or record why not",
    )
    after.add_argument("chain", type=Path, help="the chain's folder, <first run dir>/stages")
    after.add_argument("--after", type=int, required=True, help="the stage that ended")
    after.add_argument(
        "--exit-code", type=int, required=True, help="its training steps' exit status"
    )
    after.add_argument("--job", default="", help="the job that ended (recorded with the claim)")
    after.add_argument(
        "--chain-id",
        default="",
        help="the chain the job belongs to (a chain submitted again replaces it)",
    )
    after.set_defaults(func=submitting.next_stage)


def _operations_commands(sub: Any) -> None:
    """runs, plot, doctor, data, config, env: looking after runs, data and the cluster."""
    runs = sub.add_parser(
        "runs", help="a table of the runs in a folder: status, step, losses, checkpoint"
    )
    runs.add_argument(
        "folder", nargs="?", type=Path, help="where the runs are (default: logging.runs_dir)"
    )
    runs.add_argument("--json", action="store_true", help="print JSON for scripts")
    _config_args(runs)
    runs.set_defaults(func=commands.runs)

    plot = sub.add_parser("plot", help="plot runs' curves from metrics.jsonl into a PNG")
    plot.add_argument(
        "runs", nargs="+", type=Path, metavar="RUN", help="run directories to overlay"
    )
    plot.add_argument("--out", type=Path, required=True, help="the PNG to write")
    plot.add_argument(
        "--metric", default="loss,val_loss,lr", help="comma-separated (default: loss,val_loss,lr)"
    )
    plot.set_defaults(func=commands.plot)

    doctor = sub.add_parser(
        "doctor", help="preflight checks where the job will run (srun qgtrain doctor)"
    )
    _config_args(doctor)
    doctor.add_argument(
        "--collective",
        nargs="?",
        const="1,16,64",
        metavar="MB,...",
        help="all-reduce between nodes",
    )
    doctor.set_defaults(func=commands.doctor)
    _data_commands(sub)

    show = sub.add_parser("config", help="print the resolved config as YAML")
    _config_args(show)
    show.add_argument("--get", metavar="KEY", help="print one value, e.g. --get logging.runs_dir")
    show.set_defaults(func=commands.config)

    env = sub.add_parser(
        "env", help="print the rendezvous and device this process would use (run it inside srun)"
    )
    _config_args(env)
    env.set_defaults(func=commands.env)


def _data_commands(sub: Any) -> None:
    data = sub.add_parser(
        "data", help="tokenize the data before a job (prepare), or show a cache (info)"
    )
    data.set_defaults(func=lambda _: _usage(data))
    actions = data.add_subparsers(metavar="ACTION")
    prepare = actions.add_parser(
        "prepare",
        help="tokenize the configured data into data.cache_dir, e.g. on a "
        "CPU partition before the GPU job",
    )
    _config_args(prepare)
    prepare.add_argument(
        "--workers", type=int, help="tokenizing processes (default: data.prepare_workers)"
    )
    prepare.set_defaults(func=commands.data_prepare)
    info = actions.add_parser(
        "info", help="what a token cache holds: documents, tokens, splits, tokenizer, files"
    )
    info.add_argument(
        "path",
        nargs="?",
        type=Path,
        help="a cache entry, or a cache folder (default: data.cache_dir)",
    )
    info.add_argument("--json", action="store_true", help="print JSON for scripts")
    _config_args(info)
    info.set_defaults(func=commands.data_info)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return EXIT_USAGE


def _config_args(
    parser: argparse.ArgumentParser,
    config_help: str = "config file; repeat to overlay (default: ./config.yaml if present)",
) -> None:
    parser.add_argument("--config", action="append", type=Path, metavar="FILE", help=config_help)
    parser.add_argument(
        "--set",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.max_steps=100",
    )
    # SUPPRESS keeps a subcommand from resetting a top-level `qgtrain --debug train ...` to False
    parser.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
