"""Checkpoints written by older versions still resume, bit for bit. Each older version's code is
taken from this repository's history (`git archive`, as a fresh clone holds it) and trained here,
on this machine, on 2 gloo ranks, uninterrupted to step 8 with a checkpoint at step 4; a copy of
its run folder cut back to that checkpoint is resumed by today's code, whose steps 5 to 8 and final
checkpoint must equal the old run's, every bit. Both runs are made on the machine the test runs on:
a loss or a norm is a sum whose order follows the CPU's kernels (AVX2, AVX-512, the default ones),
so bits compare only within one machine.

The run folders those versions wrote on another machine (tests/data/, made as their README says)
are resumed too, and compared with their reference.json only where the arithmetic does not depend
on the CPU: the resume itself, the learning rates (Python floats), the random streams' states (a
stream's position does not depend on the kernels that draw from it) and the files' sizes."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import rank_log, records
from tests.ranks import ROOT, start_cli_ranks, wait_ranks

DATA = Path(__file__).parent / "data"
# The settings the old runs were made with (README.md there), minus the run directory
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
RESUMED = range(5, 9)


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
    """Of a checkpoint's weights and optimizer state, every bit: a replicated checkpoint's files,
    or a sharded one read whole from its DCP shards (DCP's reader is trusted here)."""
    h = hashlib.sha256()
    if (folder / "sharded").is_dir():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = folder.parent / f"{folder.name}-whole.pt"
        dcp_to_torch_save(folder / "sharded", whole)
        _feed(h, torch.load(whole, weights_only=True))
        whole.unlink()
    else:
        _feed(h, torch.load(folder / "model.pt", weights_only=True))
        _feed(h, torch.load(folder / "optim.pt", weights_only=True)["optimizer"]["state"])
    return h.hexdigest()


def rng_digest(folder: Path, rank: int) -> str:
    """Of a rank's saved random streams."""
    h = hashlib.sha256()
    _feed(h, torch.load(folder / f"rank-{rank}.pt", weights_only=True)["rng"])
    return h.hexdigest()


def train(run: Path, cwd: Path, *more: str, code: Path = ROOT) -> None:
    """`python -m qgtrain train` of the code at `code` on 2 ranks, with SETS and `more`."""
    args = ["train", "--set", *SETS, *more, "--run-dir", str(run)]
    procs = start_cli_ranks(2, args, cwd, env={"PYTHONPATH": str(code)}, log_prefix=run.name)
    assert wait_ranks(procs, 300) == [0, 0], (cwd / f"{run.name}-0.out").read_text()[-3000:]


def outcome(run: Path) -> dict[str, Any]:
    """What a run did after step 4: each step's loss, lr and grad_norm, the final evaluation, and
    its step-8 checkpoint's bits, random streams and file sizes."""
    logged = {r["step"]: r for r in records(run) if "loss" in r}
    final = [r for r in records(run) if "test_loss" in r][-1]
    step_8 = run / "checkpoints" / "step-8"
    return {
        "steps": {s: {k: logged[s][k] for k in ("loss", "lr", "grad_norm")} for s in RESUMED},
        "val_loss": final["val_loss"],
        "test_loss": final["test_loss"],
        "weights_and_optimizer": digest(step_8),
        "rng": [rng_digest(step_8, rank) for rank in (0, 1)],
        "sizes": {f.name: f.stat().st_size for f in step_8.glob("*.pt")},
    }


def cut_back(run: Path, copy: Path) -> Path:
    """A copy of a finished run as if killed before its final checkpoint: as tests/data's run
    folders were made (checkpoints/step-8, logs/ and .lock removed, nothing else changed)."""
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step-8")
    shutil.rmtree(copy / "logs")
    (copy / ".lock").unlink(missing_ok=True)
    return copy


def old_code(commit: str, into: Path) -> Path:
    """The package as `commit` had it, from this repository's history."""
    tree = into / f"qgtrain-{commit}"
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", commit, "qgtrain"], capture_output=True
    )
    assert archive.returncode == 0, (
        f"commit {commit} is not in {ROOT}'s history ({archive.stderr.decode().strip()}): "
        "these tests need a full clone (git clone without --depth, or git fetch --unshallow)"
    )
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def resumed(folder: Path, run: Path, cwd: Path, *more: str) -> dict[str, Any]:
    """A run folder copied to `run` (the format holds no absolute path) and resumed at its step 4
    by today's code."""
    shutil.copytree(folder, run)
    train(run, cwd, *more)
    assert f"resumed from {run / 'checkpoints' / 'step-4'}: step 4, epoch 0" in rank_log(run, 0)
    assert [r["step"] for r in records(run) if "loss" in r][-4:] == list(RESUMED)
    return outcome(run)


def check_against_the_old_code(commit: str, tmp_path: Path, *more: str, loss_ulps: int = 0) -> None:
    """`commit`'s own uninterrupted run here, against today's code resuming its step 4.
    `loss_ulps`: how many float32 units in the last place a step's reported loss may move where
    today's loss sums the same terms in another order (its gradients, and so the weights, the
    optimizer state and the gradient norms, are still compared bit for bit)."""
    old = tmp_path / "old"
    train(old, tmp_path, *more, code=old_code(commit, tmp_path))
    expected = outcome(old)
    got = resumed(cut_back(old, tmp_path / "killed"), tmp_path / "moved" / "run", tmp_path, *more)
    # Today's evaluation reduces its sums in another order than these versions' did, which moves
    # the last bits of the mean validation loss computed from the same weights.
    assert got.pop("val_loss") == pytest.approx(expected.pop("val_loss"), rel=1e-7)
    for step in RESUMED:
        loss, old_loss = got["steps"][step].pop("loss"), expected["steps"][step].pop("loss")
        assert abs(loss - old_loss) <= loss_ulps * float(np.spacing(np.float32(old_loss))), step
    assert got == expected


def check_the_stored_run(fixture: Path, tmp_path: Path, *more: str) -> None:
    """The run folder `fixture` holds, written by the old version on another machine, resumes; what
    does not depend on the CPU's kernels equals that machine's reference.json."""
    reference = json.loads((fixture / "reference.json").read_text())
    got = resumed(fixture / "run", tmp_path / "stored" / "run", tmp_path, *more)
    assert {str(s): got["steps"][s]["lr"] for s in RESUMED} == {
        s: step["lr"] for s, step in reference["steps"].items()
    }
    stored = reference["step_8"]
    if "rng_sha256" in stored:
        assert got["rng"] == stored["rng_sha256"]
        assert got["sizes"] == stored["sizes"]


@pytest.mark.slow
def test_a_checkpoint_written_by_26ab7a7_resumes_bit_for_bit(tmp_path):
    """26ab7a7 was the last version before the named-state checkpoint."""
    # 26ab7a7's loss cut the window's last position off (logits[:, :-1]); today's masks it
    # (ignore_index), so the mean's sum runs over other chunks: its value may round differently,
    # its gradient (1/N per token) cannot.
    check_against_the_old_code("26ab7a7", tmp_path, loss_ulps=1)
    check_the_stored_run(DATA / "checkpoint-26ab7a7", tmp_path)


@pytest.mark.slow
def test_an_fsdp_checkpoint_written_by_e69861d_resumes_bit_for_bit(tmp_path):
    """e69861d's sharded checkpoint, from before the strategy object."""
    check_against_the_old_code("e69861d", tmp_path, "train.parallel=fsdp")
    check_the_stored_run(DATA / "checkpoint-e69861d-fsdp", tmp_path, "train.parallel=fsdp")


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_checkpoint_written_by_ed77ea0_resumes_bit_for_bit(tmp_path, parallel):
    """ed77ea0's, from the strategy object's first version: before the parallel model, the
    checkpointer's storage seam and the packages that moved since (data/, runs/)."""
    check_against_the_old_code("ed77ea0", tmp_path, f"train.parallel={parallel}")


@pytest.mark.slow
def test_the_ddp_run_folder_ed77ea0_wrote_resumes(tmp_path):
    check_the_stored_run(DATA / "checkpoint-ed77ea0-ddp", tmp_path)
