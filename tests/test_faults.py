"""Faults of the filesystem under a running job: a disk that fills up during a checkpoint write, and
a run directory that cannot be written at all. Runs against: a real tmpfs of 1 MB mounted for the
test, and real 2-rank `qgtrain train` processes (gloo)."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path

import pytest

from qgtrain.state import checkpoint
from tests.helpers import train_command
from tests.ranks import start_cli_ranks, wait_ranks


def args(run: Path, *sets: str) -> list[str]:
    """A GPT-2 of ~0.1 MB whose checkpoint (weights and AdamW state) is ~0.4 MB: the 1 MB disk holds
    the run's first checkpoint and its logs, and fills up while writing the second."""
    return train_command(
        run,
        "data.name=synthetic",
        "data.seq_len=16",
        "train.batch_size=4",
        "train.max_steps=40",
        "train.log_every=1",
        "train.eval_every=0",
        "checkpoint.every_steps=5",
        "checkpoint.keep_last=5",
        "logging.tensorboard=false",
        "model.hidden=32",
        "model.heads=2",
        "model.layers=1",
        "optim.warmup_steps=2",
        *sets,
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "parallel, async_save", [("ddp", False), ("ddp", True), ("fsdp", False), ("fsdp", True)]
)
def test_a_disk_that_fills_during_a_checkpoint_stops_every_rank_and_keeps_the_previous_one(
    tmp_path, small_disk, parallel, async_save
):
    """Under fsdp every rank writes its own shard (torch.distributed.checkpoint): the same
    outcome."""
    run = small_disk / "run"
    procs = start_cli_ranks(
        2,
        args(run, f"checkpoint.async_save={str(async_save).lower()}", f"train.parallel={parallel}"),
        tmp_path,
    )
    assert wait_ranks(procs, 120) == [1, 1]
    outputs = [(tmp_path / f"rank-{r}.out").read_text() for r in (0, 1)]
    for output in outputs:
        last = output.strip().splitlines()[-1]
        assert last.startswith("qgtrain: error: checkpoint at step") and "Traceback" not in output
        assert (
            "no space left on the filesystem of" in last
            and "MB free, the checkpoint needs about" in last
        )
    folders = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert not [name for name in folders if name.startswith(".")], (
        f"nothing half-written is left: {folders}"
    )
    assert folders, "the first checkpoint fitted"
    for folder in folders:
        ckpt = checkpoint.read_manifest(run / "checkpoints" / folder)
        assert ckpt is not None and checkpoint.verify(ckpt) is None, f"{folder} stays valid"
        assert (run / "checkpoints" / folder / "sharded").is_dir() == (parallel == "fsdp")
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "failed" and "no space left" in status["error"]


class Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_metrics_record_a_full_disk_will_not_take_is_said_once_and_training_goes_on(small_disk):
    """The disk fills while a report is written (an asynchronous checkpoint took the space): the
    record is not the run's failure (the checkpoint's is, on every rank, as the test above holds),
    so it is said once and the run goes on; once there is space again, records are written again
    and every reader finds them."""
    from qgtrain.training.metrics import MetricsLog, read_metrics

    run = small_disk / "run"
    run.mkdir()
    metrics = MetricsLog(run, is_main=True, tensorboard=False, resume_step=None)
    metrics.write({"step": 1, "loss": 1.0})
    filler = small_disk / "filler"
    with pytest.raises(OSError):
        filler.write_bytes(b"\0" * 2**21)  # 2 MB onto the 1 MB disk: full
    logger, handler = logging.getLogger("qgtrain"), Said()
    logger.addHandler(handler)
    try:
        for step in (2, 3):  # each more than the page the file already has
            metrics.write({"step": step, "loss": 1.0, "note": "x" * 10_000})
    finally:
        logger.removeHandler(handler)
    said = [line for line in handler.lines if "could not be written" in line]
    assert len(said) == 1 and "No space left on device" in said[0], said
    filler.unlink()
    metrics.write({"step": 4, "loss": 1.0})
    metrics.close()
    steps = [r["step"] for r in read_metrics(metrics.path)]
    assert steps[0] == 1 and steps[-1] == 4, steps


def test_a_run_directory_that_cannot_be_written_is_one_line_and_exit_2(tmp_path, small_disk):
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    procs = start_cli_ranks(2, args(small_disk / "run"), tmp_path)
    assert wait_ranks(procs, 120) == [2, 2]
    for rank in (0, 1):
        output = (tmp_path / f"rank-{rank}.out").read_text()
        assert "Traceback" not in output
        assert (
            f"the run directory {small_disk / 'run'} cannot be written (Read-only file system"
            in output
        )


def test_a_run_directory_that_another_node_does_not_share_is_refused_before_training(
    tmp_path, root
):
    """Rank 1 runs in a mount namespace of its own with a private tmpfs over the runs folder: the
    same path, another filesystem, as on a node that mounts scratch space locally."""
    runs = tmp_path / "runs"
    runs.mkdir()
    procs = start_cli_ranks(
        2,
        args(runs / "run"),
        tmp_path,
        wrap={1: ["unshare", "-m", "sh", "-c", f'mount -t tmpfs tmpfs "{runs}" && exec "$0" "$@"']},
    )
    assert wait_ranks(procs, 120) == [2, 2]
    for rank in (0, 1):
        last = (tmp_path / f"rank-{rank}.out").read_text().strip().splitlines()[-1]
        assert (
            f"rank(s) [1] do not see the run directory {runs / 'run'} that rank 0 created" in last
        )
        assert "must be on a filesystem every node mounts" in last
    assert not (runs / "run" / "metrics.jsonl").exists(), "refused before training"
