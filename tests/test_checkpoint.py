"""Checkpoint format and resume selection. Runs against: real files on disk, and real single-rank
training runs (tests/ranks.py) that save, get damaged, and resume."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

from qgtrain.foundation.errors import CheckpointError
from qgtrain.state import checkpoint, rotation
from qgtrain.state.host_copy import HostCopy
from qgtrain.state.resume import resume_candidates
from qgtrain.state.storage import Storage
from tests.helpers import records, tiny_config
from tests.ranks import run_ranks, train_rank


def commit_step(
    root: Path, step: int, run_id: str, val_loss: float | None = None
) -> checkpoint.Checkpoint:
    storage = Storage(root, run_id)
    staging = storage.stage(step)
    files = checkpoint.write_files(staging, {"model.pt": {"w": torch.full((4,), float(step))}})
    return storage.commit(staging, step, files, {"val_loss": val_loss})


def test_a_committed_checkpoint_verifies_and_loads(tmp_path):
    ckpt = commit_step(tmp_path, 7, "run-a", 1.5)
    assert checkpoint.verify(ckpt) is None
    assert [c.step for c in checkpoint.list_committed(tmp_path)] == [7]
    assert torch.equal(checkpoint.load_file(ckpt, "model.pt")["w"], torch.full((4,), 7.0))
    assert not list(tmp_path.glob(".tmp-*")), "the staging folder is renamed, not copied"


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-10]), "has {n} bytes, the manifest says"),
        (
            lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])),
            "does not match its checksum",
        ),
        (lambda p: p.unlink(), "cannot be read"),
    ],
)
def test_damaged_files_are_named_by_verify(tmp_path, damage, message):
    ckpt = commit_step(tmp_path, 3, "run-a")
    path = ckpt.path / "model.pt"
    size = path.stat().st_size
    damage(path)
    problem = checkpoint.verify(ckpt)
    assert problem is not None and str(path) in problem
    assert message.format(n=size - 10) in problem


def test_folders_without_a_valid_manifest_never_count(tmp_path):
    commit_step(tmp_path, 2, "run-a")
    (tmp_path / "step-9").mkdir()  # a folder someone made by hand
    (tmp_path / "step-10").mkdir()
    (tmp_path / "step-10" / checkpoint.MANIFEST).write_text(
        '{"format": "qgtrain-checkpoint-1", "step"'
    )
    checkpoint.staging_dir(tmp_path, 12, "run-a").mkdir()  # half-written
    assert [c.step for c in checkpoint.list_committed(tmp_path)] == [2]


def test_rotation_keeps_the_last_k_and_the_best_and_never_touches_another_run(tmp_path):
    stale = commit_step(tmp_path, 999_999, "other-run", 0.01)
    for step in range(10, 210, 10):
        commit_step(tmp_path, step, "run-a", val_loss=1.0 if step == 50 else 2.0 + step / 1000)
        rotation.rotate(tmp_path, "run-a", keep_last=2)
    ours = [c.step for c in checkpoint.list_committed(tmp_path) if c.run_id == "run-a"]
    assert ours == [50, 190, 200], (
        "newest two by step number (not by name: 90 < 100), plus the best"
    )
    assert checkpoint.verify(checkpoint.read_manifest(stale.path)) is None, (
        "another run's folder is untouched"
    )


def test_a_runs_storage_stages_lists_rotates_and_cleans_only_its_own_checkpoints(tmp_path):
    """The seam the saves, a start's candidates and a rollback share: one run's view of the
    folder."""
    mine, theirs = Storage(tmp_path, "run-a"), Storage(tmp_path, "run-b")
    for step, run_id in ((3, "run-b"), (2, "run-a"), (4, "run-a")):
        commit_step(tmp_path, step, run_id)
    (mine.stage(6) / "half-written").write_text("x")
    assert not any(mine.stage(6).iterdir()), "a stage replaces what an earlier attempt left"
    half_theirs = theirs.stage(7)
    (tmp_path / "step-9").mkdir()  # no manifest
    ours, foreign = mine.committed()
    assert [c.step for c in ours] == [2, 4]
    assert foreign == ["run-b"] and Storage(tmp_path, None).committed()[1] == ["run-a", "run-b"]
    assert mine.unreadable() == [tmp_path / "step-9"]
    warnings: list[str] = []
    found = resume_candidates(mine, "auto", warnings.append)
    assert found.paths == [str(tmp_path / "step-4"), str(tmp_path / "step-2")]
    assert any("run ids run-b" in w for w in warnings) and any("step-9" in w for w in warnings)
    assert mine.clean() == [mine.staging(6)] and half_theirs.is_dir()
    assert mine.rotate(keep_last=1) == [tmp_path / "step-2"]
    assert [c.step for c in theirs.committed()[0]] == [3], "another run's checkpoint is kept"


def test_a_step_folder_of_another_run_is_set_aside_not_overwritten(tmp_path):
    theirs = commit_step(tmp_path, 4, "other-run")
    commit_step(tmp_path, 4, "run-a")
    assert checkpoint.read_manifest(tmp_path / "step-4").run_id == "run-a"
    kept = checkpoint.read_manifest(tmp_path / "step-4.from-run-other-run")
    assert kept is not None and kept.run_id == theirs.run_id


def test_a_file_that_would_run_code_is_refused(tmp_path):
    ckpt = commit_step(tmp_path, 1, "run-a")

    class Exploit:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"w": Exploit()}, ckpt.path / "model.pt", pickle_module=pickle)
    with pytest.raises(CheckpointError, match=r"model.pt cannot be loaded safely as tensors"):
        checkpoint.load_file(ckpt, "model.pt")
    assert not (tmp_path / "pwned").exists()


def synthetic(*sets: str):  # type: ignore[no-untyped-def]
    """TINY with 64 samples and a checkpoint every 2 steps."""
    return tiny_config(
        "data.synthetic_samples=64", "train.eval_every=0", "checkpoint.every_steps=2", *sets
    )


def train_once(cfg, run_dir: Path) -> dict:  # type: ignore[no-untyped-def]
    return run_ranks(1, train_rank, cfg, str(run_dir))[0]


def test_a_corrupted_or_truncated_newest_checkpoint_is_skipped_with_a_warning(tmp_path):
    run = tmp_path / "run"
    assert train_once(synthetic("train.max_steps=6"), run)["exit"] == 0
    newest = run / "checkpoints" / "step-6" / "model.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    result = train_once(synthetic("train.max_steps=8"), run)
    assert result["exit"] == 0
    log = (run / "logs" / "rank_0.log").read_text()
    assert f"skipping checkpoint step-6: {newest} has 100 bytes" in log
    assert f"resumed from {run / 'checkpoints' / 'step-4'}: step 4" in log
    steps = [record["step"] for record in records(run)]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8], (
        "records after the resumed step are replaced, not duplicated"
    )


def test_a_half_written_checkpoint_of_this_run_is_removed_and_the_last_committed_one_used(tmp_path):
    run = tmp_path / "run"
    assert train_once(synthetic("train.max_steps=4"), run)["exit"] == 0
    run_id = json.loads((run / "run.json").read_text())["run_id"]
    half = checkpoint.staging_dir(run / "checkpoints", 6, run_id)
    half.mkdir()
    (half / "model.pt").write_bytes(b"partial")
    assert train_once(synthetic("train.max_steps=6"), run)["exit"] == 0
    log = (run / "logs" / "rank_0.log").read_text()
    assert f"removed a half-written checkpoint left by a killed job: {half}" in log
    assert "resumed from" in log and "step-4: step 4" in log
    assert checkpoint.read_manifest(run / "checkpoints" / "step-6") is not None


def test_resume_from_an_explicit_corrupt_path_fails_clearly(tmp_path):
    run = tmp_path / "run"
    assert train_once(synthetic("train.max_steps=2"), run)["exit"] == 0
    target = run / "checkpoints" / "step-2"
    (target / "optim.pt").write_bytes(b"garbage")
    result = train_once(synthetic("train.max_steps=4", f"checkpoint.resume={target}"), run)
    assert (
        result["exit"] == 2
        and f"checkpoint.resume: {target / 'optim.pt'} has 7 bytes" in result["error"]
    )
    missing = train_once(
        synthetic("train.max_steps=4", f"checkpoint.resume={tmp_path / 'nope'}"), run
    )
    assert missing["exit"] == 2 and "is not a committed checkpoint" in missing["error"]


def test_a_checkpoint_of_another_model_shape_says_what_differs(tmp_path):
    run = tmp_path / "run"
    assert (
        train_once(
            synthetic(
                "train.max_steps=2",
                "model.factory=null",
                "model.hidden=32",
                "model.heads=2",
                "model.layers=1",
            ),
            run,
        )["exit"]
        == 0
    )
    result = train_once(
        synthetic(
            "train.max_steps=4",
            "model.factory=null",
            "model.hidden=64",
            "model.heads=2",
            "model.layers=1",
        ),
        run,
    )
    assert result["exit"] == 2
    # the byte vocabulary's 257 rows padded to 320 (tasks/lm_shape.py)
    assert (
        "does not fit the configured model: shapes differ (transformer.wte.weight: checkpoint "
        "(320, 32) vs model (320, 64)" in result["error"]
    ), result["error"]


def test_an_async_snapshot_is_a_private_copy_that_keeps_tied_weights_tied_and_reuses_its_buffers():
    tied = torch.nn.Linear(4, 4)
    state = {
        "model.pt": {
            "wte": tied.weight.detach(),
            "lm_head": tied.weight.detach(),
            "b": tied.bias.detach(),
        },
        "optim.pt": {"state": {0: {"step": torch.tensor(3.0)}}, "groups": [{"lr": 0.1}]},
        "config": b"x: 1",
    }
    snapshots = HostCopy()
    first = snapshots.copy(state)
    with torch.no_grad():
        tied.weight.add_(1.0)  # training goes on while the snapshot is written
    assert not torch.equal(first["model.pt"]["wte"], tied.weight)
    assert first["model.pt"]["wte"] is first["model.pt"]["lm_head"], (
        "one tensor saved once, as torch.save would"
    )
    assert first["optim.pt"]["groups"] == [{"lr": 0.1}] and first["config"] == b"x: 1"
    second = snapshots.copy(state)
    assert second["model.pt"]["wte"] is first["model.pt"]["wte"], "the next save reuses the buffers"
    assert torch.equal(second["model.pt"]["wte"], tied.weight)
    assert torch.equal(second["optim.pt"]["state"][0]["step"], torch.tensor(3.0))


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under folder with its bytes, except the lock (its owner line changes with every
    start)."""
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def test_a_run_whose_checkpoints_are_all_corrupt_is_refused_and_left_untouched(tmp_path):
    run = tmp_path / "run"
    assert train_once(synthetic("train.max_steps=4"), run)["exit"] == 0
    for step in (2, 4):
        path = run / "checkpoints" / f"step-{step}" / "optim.pt"
        data = bytearray(path.read_bytes())
        data[100] ^= 0xFF
        path.write_bytes(bytes(data))
    before = tree(run)
    result = train_once(synthetic("train.max_steps=8"), run)
    assert result["exit"] == 2
    assert "holds 2 checkpoint(s) of this run and none can be resumed" in result["error"]
    for step in (2, 4):
        assert (
            f"step-{step}: {run / 'checkpoints' / f'step-{step}' / 'optim.pt'} does not match its "
            "checksum" in result["error"]
        )
    assert "checkpoint.resume: never" in result["error"]
    assert tree(run) == before, "neither checkpoints, metrics, config nor status may change"


def test_an_optimizer_state_of_the_wrong_shape_is_refused_and_the_status_left_as_it_was(tmp_path):
    run = tmp_path / "run"
    assert train_once(synthetic("train.max_steps=2"), run)["exit"] == 0
    folder = run / "checkpoints" / "step-2"
    saved = torch.load(folder / "optim.pt", weights_only=True)
    saved["optimizer"]["state"][0]["exp_avg"] = torch.zeros(3, 3)
    torch.save(saved, folder / "optim.pt")
    # a consistent file, checksum and all
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    manifest["files"]["optim.pt"] = checkpoint.file_entry(folder / "optim.pt")
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    before = (run / "status.json").read_bytes()
    result = train_once(synthetic("train.max_steps=4"), run)
    assert result["exit"] == 2
    assert (
        f"{folder / 'optim.pt'} does not fit the configured model and optimizer (state 'exp_avg' "
        "of "
        "parameter 0 has shape (3, 3)" in result["error"]
    )
    # refused before training began: the finished run still reads finished
    assert (run / "status.json").read_bytes() == before


def test_a_newest_checkpoint_without_its_manifest_is_passed_over_with_a_warning(tmp_path):
    run = tmp_path / "run"
    assert train_once(synthetic("train.max_steps=4"), run)["exit"] == 0
    (run / "checkpoints" / "step-4" / checkpoint.MANIFEST).unlink()
    assert train_once(synthetic("train.max_steps=6"), run)["exit"] == 0
    log = (run / "logs" / "rank_0.log").read_text()
    assert f"passing over {run / 'checkpoints' / 'step-4'}: it has no valid manifest.json" in log
    assert f"resumed from {run / 'checkpoints' / 'step-2'}: step 2" in log


def save_while_rank_0_stays_away(root: str) -> float | None:
    """Rank 1 saves; rank 0 never joins the save and stays in the group until rank 1 is done (or two
    minutes have passed). Rank 1 returns how long its save took to fail."""
    import time

    from qgtrain.config import CheckpointConfig
    from qgtrain.runtime import distributed
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.state.checkpointer import Checkpointer

    env = from_environ(os.environ)
    done = Path(root, "rank-1-done")
    with distributed.process_group(env, torch.device("cpu"), 60, 60):
        saver = Checkpointer(
            Path(root, "checkpoints"), "run", env, CheckpointConfig(keep_last=2), timeout_s=3
        )
        if env.rank == 0:
            deadline = time.monotonic() + 120
            while not done.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            return None
        started = time.monotonic()
        try:
            saver.save(1, dict, {"rng": None}, {})
            failure = None
        except RuntimeError as exc:  # gloo's timeout (a DistBackendError)
            failure = type(exc).__name__
        failed_after = time.monotonic() - started
        done.touch()
        return failure, failed_after


def test_a_save_whose_peer_never_comes_fails_within_the_collective_timeout(tmp_path):
    """A rank cut off in the middle of a save must not outlive the others by gloo's default half
    hour: the saver's collectives are bounded by its 3 s timeout like training's (run against a
    real 2-rank gloo group)."""
    _, (failure, failed_after) = run_ranks(2, save_while_rank_0_stays_away, str(tmp_path))
    assert failure is not None, "the save completed without its peer"
    assert 3 <= failed_after < 15, f"the save failed after {failed_after:.1f} s, not its 3 s"
    assert not (tmp_path / "checkpoints" / "step-1").exists(), "a save without its peer committed"


def test_a_checkpoint_holds_exactly_the_names_layout_declares(tmp_path):
    """layout.py is the one owner of a checkpoint's names: a name written elsewhere, or one it
    declares that nothing writes, shows here. A built-in GPT-2 (hf_config.json) with an EMA
    (ema.pt), one rank."""
    from qgtrain.state import layout

    run = tmp_path / "run"
    cfg = synthetic(
        "train.max_steps=2",
        "train.ema_decay=0.9",
        "model.factory=",
        "model.hidden=32",
        "model.layers=2",
        "model.heads=2",
    )
    assert train_once(cfg, run)["exit"] == 0
    folder = run / "checkpoints" / layout.step_folder(2)
    assert layout.STEP_PATTERN.fullmatch(folder.name)
    names = {entry.name for entry in folder.iterdir()}
    assert names == layout.top_level(1, sharded=False, ema=True, hf_config=True)
    ckpt = checkpoint.read_manifest(folder)
    assert ckpt is not None and set(ckpt.manifest["files"]) == names - {layout.MANIFEST}
