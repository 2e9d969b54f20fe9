"""`qgtrain.train`: the Python entry point, for a task built in a script run under srun or torchrun.

    import qgtrain
    cfg = qgtrain.load_config(["config.yaml"], ["train.max_steps=2000"])
    raise SystemExit(qgtrain.train(cfg, task=my_task_function))

Every rank runs the script; the ranks find each other from the launcher's variables, as `qgtrain
train` does. The return value is the documented exit code (0, or 75/76 after a stop at a
checkpoint).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..config import RunConfig
from ..config.load import config_files, load_config
from ..foundation.files import owner_writes_only
from ..run import train as _train
from ..runtime.rendezvous import from_environ
from ..tasks.build import TaskSource


@owner_writes_only()  # as `qgtrain train`: nothing it writes is group-writable
def train(
    config: RunConfig | str | Path | None = None,
    *,
    task: TaskSource | None = None,
    run_dir: str | Path | None = None,
) -> int:
    """Train `task` (a Task, or a function of the config returning one; default: the config's
    task.factory) under `config` (a RunConfig, or a YAML file; default: ./config.yaml if there is
    one, else the built-in defaults, as `qgtrain train` does)."""
    cfg = config if isinstance(config, RunConfig) else load_config(config_files(config))
    return _train(cfg, from_environ(os.environ), run_dir, task=task)
