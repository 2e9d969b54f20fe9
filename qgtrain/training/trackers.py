"""Experiment trackers (Weights & Biases, MLflow) that keep one tracker run per qgtrain run across
requeues.

Each tracker's run id is kept in <run dir>/trackers.json (written once, before the first value is
sent), so every restart and resume continues the same tracker run. Steps never go backwards and none
is sent twice: at each start the last step of every metric is read from the tracker's own record
(MLflow's metric history, W&B's step counter), never from a file of ours that a kill could leave one
step behind the tracker. A resumed run skips what the tracker already has; a killed job logs past
its last checkpoint, and resume is exact, so those values are the ones the resumed run would send
again. W&B's offline mode keeps no record a new start can read: it buffers, so a killed job may
leave nothing on disk, and every start writes a new offline file; each start therefore replays the
run's history (metrics.jsonl up to the resumed step) into its file before logging on, so the newest
file alone holds the whole step axis. A tracker that fails (no library, bad credentials, no network
in online mode) warns once and is dropped: training never stops for a tracker. Neither library is
imported unless configured; both work without a network (W&B's offline mode, synced later with
`wandb sync`; MLflow's file store). A credential in a tracker's setting (MLFLOW_TRACKING_URI's
password, WANDB_API_KEY) is passed to the library but never logged (redact.py).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import LoggingConfig, RunConfig
from ..config.load import config_to_dict
from ..foundation.errors import ConfigError, first_line
from ..foundation.files import write_atomic
from ..foundation.redact import mask_setting, mask_text
from ..runs.rundir import RunDir
from ..runtime.rendezvous import DistEnv
from .metrics import MetricsLog

if TYPE_CHECKING:
    from ..runtime.startup import Timeline

log = logging.getLogger("qgtrain")
EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}  # tracker -> the module it needs
Send = Callable[[int, dict[str, float]], None]
Close = Callable[[bool], None]


@dataclass
class Opened:
    """A tracker run as its library gave it: the id, how to send and close, and what it already
    holds."""

    run_id: str
    send: Send
    close: Close
    # per metric, from the tracker's own record
    last_steps: dict[str, int] = field(default_factory=dict)
    floor: int = 0  # no metric may be sent at or below this step (W&B online: its step counter)
    # W&B offline: resend the history at each start (see the module's docstring)
    replays: bool = False


@dataclass
class Tracker:
    """One tracker run: `log(record)` and `close(finished)`, guarded so that a failure only
    warns."""

    name: str
    opened: Opened
    broken: bool = False

    def replay(self, history: list[dict[str, Any]]) -> None:
        """Called once the run's history has been cut back to the step it resumes from."""
        if self.opened.replays:
            for record in history:
                self.log(record)

    def log(self, record: dict[str, Any]) -> None:
        step, sent = int(record["step"]), self.opened.last_steps
        if self.broken or step <= self.opened.floor:
            return
        values = {
            k: float(v)
            for k, v in record.items()
            if k not in ("step", "time")
            and isinstance(v, (int, float))
            and not isinstance(v, bool)
            and step > sent.get(k, 0)
        }
        if values and self._guard("log", lambda: self.opened.send(step, values)):
            sent.update(dict.fromkeys(values, step))

    def close(self, finished: bool) -> None:
        if not self.broken:
            self._guard("close", lambda: self.opened.close(finished))

    def _guard(self, what: str, action: Callable[[], None]) -> bool:
        try:
            action()
            return True
        except Exception as exc:  # noqa: BLE001 a tracker library raises bare Exceptions
            # none may stop training
            self.broken = True
            log.warning(
                "logging.trackers: %s failed to %s (%s: %s); training goes on without it",
                self.name,
                what,
                type(exc).__name__,
                mask_text(first_line(exc, 200)),
            )
            return False


def check_installed(names: tuple[str, ...]) -> None:
    """Refuse a configured tracker whose library is missing, before any rank starts (every rank
    checks)."""
    import importlib.util

    for name in names:
        module = EXTRAS.get(name)
        if module and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"logging.trackers: {name} is not installed here; pip install 'qgtrain[{name}]' "
                f"(or {module}), or remove it from logging.trackers"
            )


def metrics_log(
    cfg: RunConfig, run_dir: Path, env: DistEnv, resume_step: int | None, timeline: Timeline
) -> MetricsLog:
    """The run's metrics log, from its logging section, with rank 0's trackers opened."""
    given = cfg.logging
    check_installed(given.trackers)
    opened = open_trackers(given, run_dir, run_dir.name, config_to_dict(cfg)) if env.is_main else []
    bar = given.progress == "bar" or (given.progress == "auto" and sys.stderr.isatty())
    tensorboard = given.tensorboard or "tensorboard" in given.trackers
    return MetricsLog(
        run_dir,
        env.is_main,
        tensorboard,
        resume_step,
        progress_bar=bar,
        max_steps=cfg.train.max_steps,
        memory_warn_gb=given.memory_warn_gb,
        timeline=timeline,
        trackers=opened,
    )


def open_trackers(
    cfg: LoggingConfig,
    run_dir: Path,
    run_name: str,
    config: dict[str, Any],
    environ: Mapping[str, str] = os.environ,
) -> list[Tracker]:
    """The configured trackers, continuing the tracker runs recorded in the run directory (rank 0
    only)."""
    state_path = RunDir(run_dir).trackers
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    opened = []
    for name in (n for n in cfg.trackers if n in EXTRAS):
        try:
            run = STARTERS[name](cfg, run_dir, run_name, config, state.get(f"{name}_id"), environ)
        except Exception as exc:  # noqa: BLE001 a tracker library raises bare Exceptions
            # none may stop training
            log.warning(
                "logging.trackers: %s could not start (%s: %s); training goes on without it",
                name,
                type(exc).__name__,
                mask_text(first_line(exc, 200)),
            )
            continue
        state[f"{name}_id"] = run.run_id
        write_atomic(state_path, json.dumps(state, indent=1))
        opened.append(Tracker(name, run))
        log.info("logging to %s run %s", name, run.run_id)
    return opened


def tracker_setting(cfg: LoggingConfig, key: str, variable: str, environ: Mapping[str, str]) -> str:
    """The tracker's own environment variable where the config leaves `key` at its default (a site
    sets them once for every tool); a value set in the config wins. The log says which was used,
    masked."""
    value, default = (
        getattr(cfg, key),
        next(f.default for f in fields(LoggingConfig) if f.name == key),
    )
    given = environ.get(variable)
    if value == default and given:
        shown = mask_setting(variable, given)
        log.info("logging.%s: using %s=%s from the environment", key, variable, shown)
        return given
    if value != default and given and given != value:
        log.info(
            "logging.%s: %s from the config (the environment's %s=%s is not used)",
            key,
            mask_setting(variable, str(value)),
            variable,
            mask_setting(variable, given),
        )
    return str(value)


def _wandb(
    cfg: LoggingConfig,
    run_dir: Path,
    run_name: str,
    config: dict[str, Any],
    run_id: str | None,
    environ: Mapping[str, str],
) -> Opened:
    import wandb

    mode: Any = tracker_setting(cfg, "wandb_mode", "WANDB_MODE", environ)  # wandb checks the value
    run = wandb.init(
        project=tracker_setting(cfg, "wandb_project", "WANDB_PROJECT", environ),
        entity=environ.get("WANDB_ENTITY") or None,
        name=run_name,
        id=run_id,
        resume="allow",
        dir=environ.get("WANDB_DIR") or str(run_dir),
        mode=mode,
        config=config,
        settings=wandb.Settings(silent=True, console="off"),
    )

    def close(finished: bool) -> None:
        run.finish(exit_code=0 if finished else 1)

    def send(step: int, values: dict[str, float]) -> None:
        run.log(values, step=step)

    if mode == "offline":
        return Opened(str(run.id), send, close, replays=True)
    # step: that of the next log()
    return Opened(str(run.id), send, close, floor=max(int(run.step) - 1, 0))


def _mlflow(
    cfg: LoggingConfig,
    run_dir: Path,
    run_name: str,
    config: dict[str, Any],
    run_id: str | None,
    environ: Mapping[str, str],
) -> Opened:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    uri = (
        tracker_setting(cfg, "mlflow_uri", "MLFLOW_TRACKING_URI", environ)
        or Path(cfg.runs_dir).resolve().joinpath("mlruns").as_uri()
    )
    # MLflow 3 keeps the file store only on request; on a cluster's shared
    if uri.startswith("file:"):
        from mlflow.environment_variables import (
            MLFLOW_ALLOW_FILE_STORE,  # filesystem it beats SQLite's locks
        )

        if not MLFLOW_ALLOW_FILE_STORE.is_set():
            MLFLOW_ALLOW_FILE_STORE.set("true")
    client = MlflowClient(tracking_uri=uri)
    if run_id is None:
        name = tracker_setting(cfg, "mlflow_experiment", "MLFLOW_EXPERIMENT_NAME", environ)
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        run_id = str(client.create_run(experiment_id, run_name=run_name).info.run_id)
        flat = [
            Param(f"{section}.{key}", str(value)[:500])
            for section, values in config.items()
            for key, value in values.items()
        ]
        for start in range(0, len(flat), 100):
            client.log_batch(run_id, params=flat[start : start + 100])
    else:
        client.update_run(run_id, status="RUNNING")
    own_id = run_id
    last_steps = {
        key: max(m.step for m in client.get_metric_history(own_id, key))
        for key in client.get_run(own_id).data.metrics
    }

    def send(step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        client.log_batch(
            own_id, metrics=[Metric(key, value, now, step) for key, value in values.items()]
        )

    def close(finished: bool) -> None:
        client.set_terminated(own_id, status="FINISHED" if finished else "KILLED")

    return Opened(own_id, send, close, last_steps)


# logging.trackers -> what starts (or continues) its run; tensorboard is MetricsLog's own
STARTERS: dict[str, Callable[..., Any]] = {"wandb": _wandb, "mlflow": _mlflow}
