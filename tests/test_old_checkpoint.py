"""Checkpoints written before the named-state checkpoint still resume, bit for bit. Runs against:
a run directory written by commit 26ab7a7's own `qgtrain train` (2 gloo ranks, CPU; committed in
tests/data/checkpoint-26ab7a7, made as its README says), resumed here by today's code on 2 real
ranks, and the numbers of 26ab7a7's uninterrupted run (reference.json)."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers import rank_log, records
from tests.ranks import start_cli_ranks, wait_ranks

OLD = Path(__file__).parent / "data" / "checkpoint-26ab7a7"
OLD_FSDP = Path(__file__).parent / "data" / "checkpoint-e69861d-fsdp"
# The settings the old run was made with (README.md there), minus its run directory
SETS = [
    "train.max_steps=8",
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=3",
    "train.eval_every=4",
    "train.eval_batches=2",
    "model.layers=1",
    "model.heads=2",
    "model.hidden=16",
    "model.dropout=0.1",
    "data.name=synthetic",
    "data.seq_len=16",
    "data.synthetic_samples=256",
    "train.batch_size=4",
    "train.grad_accum_steps=2",
    "optim.warmup_steps=2",
    "train.log_every=1",
    "logging.tensorboard=false",
    "data.num_workers=0",
]


def _feed(h: Any, obj: Any) -> None:
    if isinstance(obj, torch.Tensor):
        h.update(f"{obj.dtype}{tuple(obj.shape)}".encode())
        h.update(obj.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            h.update(str(key).encode())
            _feed(h, obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _feed(h, item)
    else:
        h.update(repr(obj).encode())


def digest(folder: Path) -> str:
    """Of a replicated checkpoint's weights and optimizer state, every bit."""
    h = hashlib.sha256()
    _feed(h, torch.load(folder / "model.pt", weights_only=True))
    _feed(h, torch.load(folder / "optim.pt", weights_only=True)["optimizer"]["state"])
    return h.hexdigest()


def sharded_digest(folder: Path) -> str:
    """Of a sharded checkpoint's weights and optimizer state, every bit, read whole from its DCP
    shards (a fixture of our own: DCP's reader is trusted here)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = folder.parent / f"{folder.name}-whole.pt"
    dcp_to_torch_save(folder / "sharded", whole)
    h = hashlib.sha256()
    _feed(h, torch.load(whole, weights_only=True))
    return h.hexdigest()


def rng_digest(folder: Path, rank: int) -> str:
    """Of a rank's saved random streams."""
    h = hashlib.sha256()
    _feed(h, torch.load(folder / f"rank-{rank}.pt", weights_only=True)["rng"])
    return h.hexdigest()


def resumed_old_run(fixture: Path, run: Path, tmp_path: Path, *more: str) -> dict[str, Any]:
    """The fixture's run copied to `run` and resumed at its step 4 on 2 ranks of today's code: its
    steps 5 to 8 must be the old uninterrupted run's (reference.json); returns that reference and
    the final evaluation record."""
    reference = json.loads((fixture / "reference.json").read_text())
    shutil.copytree(fixture / "run", run)
    args = ["train", "--set", *SETS, *more, "--run-dir", str(run)]
    assert wait_ranks(start_cli_ranks(2, args, tmp_path), 300) == [0, 0], (
        tmp_path / "rank-0.out"
    ).read_text()[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step-4'}: step 4, epoch 0" in rank_log(run, 0)
    logged = {r["step"]: r for r in records(run) if "loss" in r}
    assert {
        str(step): {key: logged[step][key] for key in ("loss", "lr", "grad_norm")}
        for step in range(5, 9)
    } == reference["steps"]
    return {**reference, "final": [r for r in records(run) if "test_loss" in r][-1]}


@pytest.mark.slow
def test_a_checkpoint_written_by_26ab7a7_resumes_bit_for_bit_from_a_copy(tmp_path):
    """The old run directory is copied elsewhere (the format holds no absolute path) and resumed at
    its step 4: steps 5 to 8 and the final checkpoint equal 26ab7a7's uninterrupted run's, and the
    files a checkpoint holds keep their sizes."""
    run = tmp_path / "moved" / "run"
    reference = resumed_old_run(OLD, run, tmp_path)
    final = reference["final"]
    assert final["test_loss"] == reference["test_loss"]
    # The weights it is computed from are equal (below); today's evaluation reduces its sums in
    # another order than 26ab7a7's, which moves the last bits of this mean (so does today's
    # uninterrupted run: 5.52797269821167).
    assert final["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-7)

    step_8, old = run / "checkpoints" / "step-8", reference["step_8"]
    assert digest(step_8) == old["weights_and_optimizer_sha256"]
    assert [rng_digest(step_8, rank) for rank in (0, 1)] == old["rng_sha256"]
    assert {f.name: f.stat().st_size for f in step_8.glob("*.pt")} == old["sizes"]


@pytest.mark.slow
def test_an_fsdp_checkpoint_written_by_e69861d_resumes_bit_for_bit(tmp_path):
    """The sharded checkpoint of e69861d's fsdp run (before the strategy object) resumed at step 4
    on today's code: steps 5 to 8 and the final sharded checkpoint equal e69861d's uninterrupted
    run's, bit for bit."""
    run = tmp_path / "run"
    reference = resumed_old_run(OLD_FSDP, run, tmp_path, "train.parallel=fsdp")
    final = reference["final"]
    assert final["test_loss"] == pytest.approx(reference["test_loss"], rel=1e-7)
    assert final["val_loss"] == pytest.approx(reference["val_loss"], rel=1e-7)
    step_8 = reference["step_8"]["weights_and_optimizer_sha256"]
    assert sharded_digest(run / "checkpoints" / "step-8") == step_8
