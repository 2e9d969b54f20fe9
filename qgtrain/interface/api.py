"""`qgtrain.train`: the Python entry point, for a task built in a script run under srun or torchrun.

    import qgtrain
    cfg = qgtrain.load_config(["config.yaml"], ["train.max_steps=2000"])
    raise SystemExit(qgtrain.train(cfg, task=my_task_function))

Every rank runs the script; the ranks find each other from the launcher's variables, as `qgtrain
train` does. The return value is the documented exit code (0, or 75/76 after a stop at a
checkpoint) as a TrainResult: an int that also says where the run is and, on rank 0, its last step
and figures, so a script goes on from there without reading the run's files itself.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import RunConfig
from ..config.load import config_files, load_config
from ..foundation.files import owner_writes_only
from ..foundation.result import TrainResult
from ..run import train as _train
from ..runs.rundir import RunDir, default_run_dir
from ..runtime.rendezvous import from_environ
from ..tasks.build import TaskSource
from ..training.metrics import read_metrics


@owner_writes_only()  # as `qgtrain train`: nothing it writes is group-writable
def train(
    config: RunConfig | str | Path | None = None,
    *,
    task: TaskSource | None = None,
    run_dir: str | Path | None = None,
) -> TrainResult:
    """Train `task` (a Task, or a function of the config returning one; default: the config's
    task.factory) under `config` (a RunConfig, or a YAML file; default: ./config.yaml if there is
    one, else the built-in defaults, as `qgtrain train` does)."""
    cfg = config if isinstance(config, RunConfig) else load_config(config_files(config))
    env = from_environ(os.environ)
    # the directory the run claims (runs/claim.py), resolved before training as it resolves it
    path = (Path(run_dir) if run_dir else default_run_dir(cfg)).resolve()
    code = _train(cfg, env, run_dir, task=task)
    return _result(code, path) if env.is_main else TrainResult(code, path)


def _result(code: int, path: Path) -> TrainResult:
    """The result with the run's last step and the latest value of each figure it logged."""
    metrics_file = RunDir(path).metrics
    figures: dict[str, float] = {}
    step = None
    for record in read_metrics(metrics_file) if metrics_file.exists() else []:
        step = record.get("step", step)
        figures.update(
            (name, value)
            for name, value in record.items()
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
        )
    return TrainResult(code, path, step if isinstance(step, int) else None, figures)
