"""Experiment trackers (Weights & Biases, MLflow) that keep one tracker run per qgtrain run across requeues.

Each tracker's run id is kept in <run dir>/trackers.json, so every restart and resume continues the same
tracker run. Steps never go backwards: trackers.json also keeps the last step each tracker received, and a
resumed run skips the steps it has already sent. A killed job logs past its last checkpoint, and resume is
exact, so the values it sent for those steps are the ones the resumed run would send again. W&B's offline
mode is the exception: it buffers, so a killed job may leave nothing on disk, and every start writes a new
offline file; each start therefore replays the run's history (metrics.jsonl up to the resumed step) into
its file before logging on, so the newest file alone holds the whole step axis. A tracker that
fails (no library, bad credentials, no network in online mode) warns once and is dropped: training never
stops for a tracker. Neither library is imported unless configured; both work without a network (W&B's
offline mode, synced later with `wandb sync`; MLflow's file store).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import LoggingConfig
from ..errors import ConfigError, first_line

log = logging.getLogger("qgtrain")
STATE = "trackers.json"
EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}  # tracker -> the module it needs


@dataclass
class Tracker:
    """One tracker run: `send(step, values)` and `close(finished)`, guarded so that a failure only warns."""

    name: str
    send: Callable[[int, dict[str, float]], None]
    close_run: Callable[[bool], None]
    last_step: int
    state: Path
    replays: bool = False  # W&B offline: resend the history at each start (see the module's docstring)
    broken: bool = False

    def replay(self, history: list[dict[str, Any]]) -> None:
        """Called once the run's history has been cut back to the step it resumes from."""
        if self.replays and history:
            for record in history:
                self._send(record)
            _update(self.state, {f"{self.name}_last_step": self.last_step})

    def log(self, record: dict[str, Any]) -> None:
        if self._send(record):
            _update(self.state, {f"{self.name}_last_step": self.last_step})

    def _send(self, record: dict[str, Any]) -> bool:
        step = int(record["step"])
        if self.broken or step <= self.last_step:
            return False
        values = {k: float(v) for k, v in record.items() if k not in ("step", "time") and
                  isinstance(v, (int, float)) and not isinstance(v, bool)}
        if not self._guard("log", lambda: self.send(step, values)):
            return False
        self.last_step = step
        return True

    def close(self, finished: bool) -> None:
        if not self.broken:
            self._guard("close", lambda: self.close_run(finished))

    def _guard(self, what: str, action: Callable[[], None]) -> bool:
        try:
            action()
            return True
        except Exception as exc:  # noqa: BLE001 a tracker library raises bare Exceptions; none may stop training
            self.broken = True
            log.warning("logging.trackers: %s failed to %s (%s: %s); training goes on without it", self.name,
                        what, type(exc).__name__, first_line(exc, 200))
            return False


def check_installed(names: tuple[str, ...]) -> None:
    """Refuse a configured tracker whose library is missing, before any rank starts (every rank checks)."""
    import importlib.util

    for name in names:
        module = EXTRAS.get(name)
        if module and importlib.util.find_spec(module) is None:
            raise ConfigError(f"logging.trackers: {name} is not installed here; pip install 'qgtrain[{name}]' "
                              f"(or {module}), or remove it from logging.trackers")


def open_trackers(cfg: LoggingConfig, run_dir: Path, run_name: str, config: dict[str, Any]) -> list[Tracker]:
    """The configured trackers, continuing the tracker runs recorded in the run directory (rank 0 only)."""
    state_path = run_dir / STATE
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    opened = []
    for name in (n for n in cfg.trackers if n in EXTRAS):
        starter = {"wandb": _wandb, "mlflow": _mlflow}[name]
        try:
            run_id, send, close = starter(cfg, run_dir, run_name, config, state.get(f"{name}_id"))
        except Exception as exc:  # noqa: BLE001 a tracker library raises bare Exceptions; none may stop training
            log.warning("logging.trackers: %s could not start (%s: %s); training goes on without it", name,
                        type(exc).__name__, first_line(exc, 200))
            continue
        _update(state_path, {f"{name}_id": run_id})
        replays = name == "wandb" and cfg.wandb_mode == "offline"
        last = 0 if replays else int(state.get(f"{name}_last_step", 0))
        opened.append(Tracker(name, send, close, last, state_path, replays))
        log.info("logging to %s run %s", name, run_id)
    return opened


def _wandb(cfg: LoggingConfig, run_dir: Path, run_name: str, config: dict[str, Any],
           run_id: str | None) -> tuple[str, Callable[[int, dict[str, float]], None], Callable[[bool], None]]:
    import wandb

    run = wandb.init(project=cfg.wandb_project, name=run_name, id=run_id,
                     resume="allow", dir=str(run_dir), mode=cfg.wandb_mode, config=config,
                     settings=wandb.Settings(silent=True, console="off"))

    def close(finished: bool) -> None:
        run.finish(exit_code=0 if finished else 1)

    return str(run.id), lambda step, values: run.log(values, step=step), close


def _mlflow(cfg: LoggingConfig, run_dir: Path, run_name: str, config: dict[str, Any],
            run_id: str | None) -> tuple[str, Callable[[int, dict[str, float]], None], Callable[[bool], None]]:
    from mlflow.entities import Metric, Param
    from mlflow.tracking import MlflowClient

    uri = cfg.mlflow_uri or Path(cfg.runs_dir).resolve().joinpath("mlruns").as_uri()
    if uri.startswith("file:"):  # MLflow 3 keeps the file store only on request; on a cluster's shared
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE  # filesystem it beats SQLite's locks

        if not MLFLOW_ALLOW_FILE_STORE.is_set():
            MLFLOW_ALLOW_FILE_STORE.set("true")
    client = MlflowClient(tracking_uri=uri)
    if run_id is None:
        experiment = client.get_experiment_by_name(cfg.mlflow_experiment)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(cfg.mlflow_experiment)
        run_id = str(client.create_run(experiment_id, run_name=run_name).info.run_id)
        flat = [Param(f"{section}.{key}", str(value)[:500]) for section, values in config.items()
                for key, value in values.items()]
        for start in range(0, len(flat), 100):
            client.log_batch(run_id, params=flat[start:start + 100])
    else:
        client.update_run(run_id, status="RUNNING")
    own_id = run_id

    def send(step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        client.log_batch(own_id, metrics=[Metric(key, value, now, step) for key, value in values.items()])

    def close(finished: bool) -> None:
        client.set_terminated(own_id, status="FINISHED" if finished else "KILLED")

    return own_id, send, close


def _update(path: Path, changes: dict[str, Any]) -> None:
    state = json.loads(path.read_text()) if path.exists() else {}
    state.update(changes)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(state, indent=1))
    os.replace(tmp, path)
