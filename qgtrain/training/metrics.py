"""What a run reports: metrics.jsonl and TensorBoard on rank 0, and each rank's memory.

metrics.jsonl holds one JSON object per logged step, floats at full precision. On a start from step
N (0 for a fresh start), records after N (written before the job died) are dropped and TensorBoard
is purged from N + 1, so a run's history reads as if it had never stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
from pathlib import Path
from typing import TYPE_CHECKING, Any

# at run time torch is imported only where needed: `qgtrain runs` reads metrics without it
if TYPE_CHECKING:
    import torch

    from ..runtime.startup import Timeline
    from .trackers import Tracker

from ..foundation.errors import QgtrainError
from ..foundation.files import open_append, write_atomic
from ..runs.rundir import RunDir


class MetricsLog:
    def __init__(
        self,
        run_dir: Path,
        is_main: bool,
        tensorboard: bool,
        resume_step: int | None,
        progress_bar: bool = False,
        max_steps: int = 0,
        memory_warn_gb: float = 0.0,
        timeline: Timeline | None = None,
        trackers: list[Tracker] | None = None,
    ) -> None:
        self.timeline = timeline  # reported with the first record, then dropped
        # W&B, MLflow: rank 0's, each guarded against its own failures
        self.trackers = trackers or []
        self.path = RunDir(run_dir).metrics
        self.is_main = is_main
        self.memory_warn_gb = memory_warn_gb
        self._memory_warned: set[str] = set()
        self._write_failed = False
        self._tb: Any = None
        self._tb_dir: tuple[Path, int] | None = None
        self._bar: Any = None
        self._redirect: Any = None
        if not is_main:
            return
        if progress_bar:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self._bar = tqdm(
                total=max_steps, initial=resume_step or 0, unit="step", dynamic_ncols=True
            )
            self._redirect = logging_redirect_tqdm([logging.getLogger("qgtrain")])
            self._redirect.__enter__()  # log lines print above the bar instead of through it
        # Records past the starting step come from an attempt that died before its next checkpoint.
        start = resume_step or 0
        _truncate_after(self.path, start)
        for tracker in self.trackers:
            tracker.replay(read_metrics(self.path) if self.path.exists() else [])
        self._file = open_append(self.path)  # never through a link planted at its name
        # TensorBoard's writer is opened with the first record, after the first step: its import
        # costs a start about a third of a second that the first step does not need.
        self._tb_dir = (RunDir(run_dir).tensorboard, start + 1) if tensorboard else None

    def advance(self, step: int) -> None:
        """Called every step; moves the progress bar (rank 0 on a terminal) and nothing else."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def warn_memory(self, rank: int, step: int, record: dict[str, Any]) -> None:
        """Each rank warns about its own memory, once per quantity that crosses
        logging.memory_warn_gb."""
        limit = self.memory_warn_gb
        for key in ("mem_rss_gb", "mem_gpu_peak_gb"):
            if limit and record.get(key, 0.0) > limit and key not in self._memory_warned:
                self._memory_warned.add(key)
                logging.getLogger("qgtrain").warning(
                    "rank %d: %s is %.2f GB at step %d, above logging.memory_warn_gb=%.2f",
                    rank,
                    key,
                    record[key],
                    step,
                    limit,
                )

    def write(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        if self.timeline is not None:  # the first step: where the time before it went
            self.timeline.mark("first step")
            record["startup_s"] = dict(self.timeline.intervals)
            logging.getLogger("qgtrain").info("%s", self.timeline.describe())
            self.timeline = None
        if self._bar is not None and "loss" in record:
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
        try:
            self._append(json.dumps(record) + "\n")
        except OSError as exc:
            self._not_written(exc)
        if (tb := self._tensorboard()) is not None:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    tb.add_scalar(_tb_tag(key), value, record["step"])
        for tracker in self.trackers:
            tracker.log(record)

    def _append(self, line: str) -> None:
        """One record, whole or not at all: written past any buffer, and cut back off where the
        disk took only part of it."""
        fd, data = self._file.fileno(), line.encode()
        start = os.fstat(fd).st_size
        try:
            done = 0
            while done < len(data):
                done += os.write(fd, data[done:])
        except OSError:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start)
            raise

    def _not_written(self, exc: OSError) -> None:
        """A record the disk would not take (full, or remounted read-only): said once, and the run
        goes on. A log line is not worth a run: a checkpoint that cannot be written stops it, with
        the error that matters on every rank. The records of that time are lost; the next one the
        disk takes is written."""
        if not self._write_failed:
            logging.getLogger("qgtrain").warning(
                "%s: a record could not be written (%s); training goes on, and records are "
                "written again once the disk takes them",
                self.path,
                exc.strerror or exc,
            )
        self._write_failed = True

    def write_samples(self, step: int, task: str, samples: list[dict[str, Any]]) -> None:
        """A generate task's sample outputs as TensorBoard text (rank 0's run folder keeps the
        jsonl), one markdown block per prompt."""
        if not self.is_main or (tb := self._tensorboard()) is None:
            return
        blocks = [
            f"**{s['prompt']}** {s['output']}"
            + (f" *(answer: {s['answer']})*" if s["answer"] is not None else "")
            for s in samples
        ]
        tb.add_text(f"eval/{task}", "\n\n".join(blocks), step)

    def _tensorboard(self) -> Any:
        """The TensorBoard writer, opened at its first use (None: logging.tensorboard is off)."""
        if self._tb_dir is not None and self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(self._tb_dir[0]), purge_step=self._tb_dir[1])
        return self._tb

    def close(self, finished: bool = False) -> None:
        for tracker in self.trackers:
            tracker.close(finished)
        if self._bar is not None:
            self._redirect.__exit__(None, None, None)
            self._bar.close()
            self._bar = None
        if self.is_main:
            try:  # a full disk: the failure that stopped the run is the one to tell, not this
                self._file.close()
            except OSError as exc:
                logging.getLogger("qgtrain").warning("%s not closed cleanly: %s", self.path, exc)
            if self._tb is not None:
                self._tb.close()


def _tb_tag(key: str) -> str:
    group = (
        "val" if key.startswith(("val", "test")) else "memory" if key.startswith("mem") else "train"
    )
    return f"{group}/{key}"


def _truncate_after(path: Path, step: int) -> None:
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short when the job was killed
    write_atomic(path, "".join(line + "\n" for line in kept))


def memory_gb(device: torch.device) -> dict[str, float]:
    """This rank's resident CPU memory, and GPU memory allocated now and at peak."""
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    out = {"mem_rss_gb": rss_pages * resource.getpagesize() / 1e9}
    if device.type == "cuda":
        import torch  # here: `qgtrain runs` reads metrics on login nodes without torch

        out["mem_gpu_alloc_gb"] = torch.cuda.memory_allocated(device) / 1e9
        out["mem_gpu_peak_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
    return out


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, skipping a last line cut short by a kill."""
    records = []
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise QgtrainError(f"{path} does not exist") from None
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def prefixed(split: str, metrics: dict[str, float | None]) -> dict[str, float | None]:
    return {f"{split}_{name}": value for name, value in metrics.items()}


def format_metrics(metrics: dict[str, float | None]) -> str:
    return (
        " ".join(f"{k} {'n/a' if v is None else f'{v:.4f}'}" for k, v in metrics.items())
        or "no metrics"
    )
