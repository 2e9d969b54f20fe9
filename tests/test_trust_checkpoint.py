"""A checkpoint folder someone else could write never runs code, nor hangs a start or an export.
Runs against: real files on disk (pickles that call os.system, FIFOs, symlinks, names outside the
folder), real sharded folders written by torch.distributed.checkpoint, and real `qgtrain train` and
`qgtrain export` processes on a run whose newest checkpoint was planted as an attacker would plant
it (the manifest's checksums recomputed). A payload that ran leaves its marker file; a hang fails by
timeout."""

from __future__ import annotations

import builtins
import json
import os
import pickle
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from qgtrain.foundation.errors import CheckpointError
from qgtrain.state import checkpoint, sharded
from tests.helpers import cli, small_gpt2_run

RUN_S = 240  # a hang fails the CLI tests within this; a run takes well under it
Entry = dict[str, Any]


class Exploit:
    """Pickles as a call of `function(argument)`: unpickling it makes the call."""

    def __init__(self, function: Callable[[str], object], argument: str) -> None:
        self.function, self.argument = function, argument

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (self.function, (self.argument,))


def touch(marker: Path) -> Exploit:
    return Exploit(os.system, f"touch {marker}")


def evaluate_touch(marker: Path) -> Exploit:
    return Exploit(builtins.eval, f"__import__('os').system('touch {marker}')")


def write_dcp(folder: Path, state: dict[str, Any]) -> None:
    """A sharded/ folder as DCP writes it (one process, one file)."""
    writer = dcp.FileSystemWriter(folder, single_file_per_rank=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, storage_writer=writer, no_dist=True)


def relist(folder: Path, step: int, extra: dict[str, Entry] | None = None) -> checkpoint.Checkpoint:
    """Rewrite folder's manifest as an attacker would: every regular file in it listed with its true
    size and checksum, the step set to `step`, and `extra` entries added as they are."""
    manifest = json.loads((folder / checkpoint.MANIFEST).read_text())
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and not p.is_symlink() and p.name != checkpoint.MANIFEST
    )
    manifest["files"] = {str(p.relative_to(folder)): checkpoint.file_entry(p) for p in files}
    manifest["files"].update(extra or {})
    manifest["step"] = step
    (folder / checkpoint.MANIFEST).write_text(json.dumps(manifest))
    found = checkpoint.read_manifest(folder)
    assert found is not None
    return found


def committed(tmp_path: Path) -> checkpoint.Checkpoint:
    """A small committed checkpoint of the replicated kind."""
    staging = checkpoint.staging_dir(tmp_path / "checkpoints", 1, "run-a")
    staging.mkdir(parents=True)
    files = checkpoint.write_files(
        staging, {"model.pt": {"weight": torch.ones(2, 2)}, "state.json": b"{}"}
    )
    final = tmp_path / "checkpoints" / "step-1"
    return checkpoint.commit(staging, final, files, {"step": 1, "run_id": "run-a"})


def with_payload_in_metadata(folder: Path, payload: Exploit) -> None:
    """The checkpoint's DCP metadata, well-formed but for one field, which holds the payload."""
    path = folder / "sharded" / ".metadata"
    metadata = pickle.loads(path.read_bytes())  # our own, just written: trusted here
    metadata.planner_data = payload
    path.write_bytes(pickle.dumps(metadata))


PAYLOADS = [(touch, "posix.system"), (evaluate_touch, "builtins.eval")]


@pytest.mark.parametrize("payload, refused", PAYLOADS)
def test_verify_refuses_dcp_metadata_that_would_run_code_naming_it(tmp_path, payload, refused):
    ckpt = committed(tmp_path)
    marker = tmp_path / "PWNED"
    write_dcp(ckpt.path / "sharded", {"model": {"weight": torch.ones(2, 2)}})
    with_payload_in_metadata(ckpt.path, payload(marker))
    ckpt = relist(ckpt.path, 1)
    problem = checkpoint.verify(ckpt)
    said = f"qgtrain refuses to unpickle {refused} from {ckpt.path}/sharded/.metadata"
    assert problem is not None and said in problem and "\n" not in problem, problem
    assert checkpoint.verify(ckpt, checksums=False) is None, "the cheap pass reads nothing"
    with pytest.raises(CheckpointError, match=f"refuses to unpickle {refused}"):
        sharded.load_model(ckpt, nn.Linear(2, 2, bias=False))  # the load checks again
    assert not marker.exists()


def test_a_byte_entry_that_would_run_code_is_refused_by_verification_and_by_the_load(tmp_path):
    ckpt = committed(tmp_path)
    marker = tmp_path / "PWNED"
    write_dcp(ckpt.path / "sharded", {"model": {"weight": touch(marker)}})  # saved as bytes
    ckpt = relist(ckpt.path, 1)
    problem = checkpoint.verify(ckpt)
    assert problem is not None and "qgtrain refuses to unpickle posix.system from" in problem
    assert "sharded/__0_0.distcp (model.weight)" in problem
    with pytest.raises(CheckpointError, match="model.weight as pickled bytes where a tensor"):
        sharded.load_model(ckpt, nn.Linear(2, 2, bias=False))
    from qgtrain.state import dcp_safe  # here: the tests above run on the code before it too

    state: dict[str, Any] = {"model": {"weight": None}}  # not a tensor's place: loaded as data
    with pytest.raises(
        CheckpointError,
        match="refuses to unpickle posix.system from the sharded checkpoint's entry model.weight",
    ):
        dcp_safe.load(ckpt, state, no_dist=True)
    assert not marker.exists()


def test_a_sharded_checkpoint_of_qgtrain_s_own_kind_verifies_and_loads_whole(tmp_path):
    """What qgtrain's fsdp checkpoints hold as bytes: the optimizer's param_groups (numbers, flags,
    None, tuples, parameter names); their metadata names dtypes, sizes, layouts and paths."""
    ckpt = committed(tmp_path)
    groups = [
        {
            "lr": 1e-3,
            "betas": (0.9, 0.95),
            "eps": 1e-8,
            "amsgrad": False,
            "foreach": None,
            "params": ["weight"],
        }
    ]
    model = {
        "weight": torch.randn(3, 2),
        "half": torch.ones(4, dtype=torch.bfloat16),
        "step": torch.tensor(7),
        "t": torch.randn(2, 2).t(),
    }
    write_dcp(ckpt.path / "sharded", {"model": model, "optim": {"param_groups": groups}})
    ckpt = relist(ckpt.path, 1)
    assert checkpoint.verify(ckpt) is None
    from qgtrain.state import dcp_safe

    empty = {
        "model": {k: torch.empty_like(v) for k, v in model.items()},
        "optim": {"param_groups": [dict.fromkeys(groups[0])]},
    }
    dcp_safe.load(ckpt, empty, no_dist=True)
    assert all(torch.equal(empty["model"][k], v) for k, v in model.items())
    assert empty["optim"] == {"param_groups": groups}


def test_dcp_metadata_that_points_outside_sharded_is_refused(tmp_path):
    ckpt = committed(tmp_path)
    write_dcp(ckpt.path / "sharded", {"model": {"weight": torch.ones(2, 2)}})
    metadata = pickle.loads((ckpt.path / "sharded" / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../../../etc/hostname"
    (ckpt.path / "sharded" / ".metadata").write_bytes(pickle.dumps(metadata))
    problem = checkpoint.verify(relist(ckpt.path, 1))
    assert (
        problem is not None
        and "stores 'model.weight' in '../../../../etc/hostname', which "
        "is not a file of sharded/ that the manifest lists"
        in problem
    )


def fifo(path: Path) -> Entry:
    os.mkfifo(path)
    return {"size": 0, "xxh3": "99aa06d3014798d86001c324468d497f"}  # xxh3-128 of nothing


def outside(folder: Path) -> Entry:
    """A file beside the checkpoint folder, and its true manifest entry."""
    (folder.parent / "outside").write_text("secret")
    return checkpoint.file_entry(folder.parent / "outside")


def nested(folder: Path) -> Entry:
    (folder / "sub").mkdir()
    return outside(folder)


def linked(link: str, to_folder: bool) -> Callable[[Path], Entry]:
    def make(folder: Path) -> Entry:
        entry = outside(folder)
        os.symlink(folder.parent if to_folder else folder.parent / "outside", folder / link)
        return entry

    return make


# Each: the name listed, what makes it (given the checkpoint folder), and what the refusal says.
HOSTILE: dict[str, tuple[str, Callable[[Path], Entry], str]] = {
    "parent": ("../outside", outside, "'../outside', which is not a plain relative path"),
    "nested parent": ("sub/../../outside", nested, "which is not a plain relative path"),
    "absolute": (
        "/etc/hostname",
        lambda f: checkpoint.file_entry(Path("/etc/hostname")),
        "'/etc/hostname', which is an absolute path",
    ),
    "fifo": ("pipe", lambda f: fifo(f / "pipe"), "pipe is a FIFO (named pipe)"),
    "symlink": ("link", linked("link", False), "link is a symbolic link"),
    "linked folder": ("sub/outside", linked("sub", True), "sub is a symbolic link"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", list(HOSTILE))
def test_names_outside_the_folder_or_not_of_regular_files_are_refused_at_once(tmp_path, kind):
    ckpt = committed(tmp_path)
    name, make, said = HOSTILE[kind]
    ckpt = relist(ckpt.path, 1, {name: make(ckpt.path)})
    for checksums in (False, True):
        problem = checkpoint.verify(ckpt, checksums=checksums)
        assert problem is not None and said in problem, (checksums, problem)


@pytest.mark.timeout(60)
def test_a_fifo_read_by_its_fixed_name_is_refused_listed_or_not(tmp_path):
    """model.json and config.yaml are read by name at resume and export, listed or not."""
    ckpt = committed(tmp_path)
    os.mkfifo(ckpt.path / "model.json")
    problem = checkpoint.verify(ckpt, checksums=False)
    said = "is a FIFO (named pipe), which a checkpoint never holds"
    assert problem == f"{ckpt.path / 'model.json'} {said}"


@pytest.mark.timeout(60)
def test_loading_a_file_that_is_a_fifo_fails_at_once(tmp_path):
    ckpt = committed(tmp_path)
    for name in ("model.pt", "state.json"):
        (ckpt.path / name).unlink()
        os.mkfifo(ckpt.path / name)
    with pytest.raises(CheckpointError, match="model.pt is a FIFO"):
        checkpoint.load_file(ckpt, "model.pt")
    with pytest.raises(CheckpointError, match="state.json is a FIFO"):
        checkpoint.load_json(ckpt, "state.json")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-rank run of the small GPT-2 (the built-in model: an export imports nothing of the
    tests'), with checkpoints at steps 2 and 4."""
    tmp = tmp_path_factory.mktemp("trained")
    args = small_gpt2_run(tmp / "run", "train.max_steps=4", "checkpoint.every_steps=2")
    done = cli(*args, cwd=tmp, timeout=RUN_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp / "run"


def evil_metadata(marker: Path) -> Callable[[Path], None]:
    def plant(folder: Path) -> None:
        write_dcp(folder / "sharded", {"model": torch.load(folder / "model.pt", weights_only=True)})
        with_payload_in_metadata(folder, touch(marker))

    return plant


def evil_bytes(marker: Path) -> Callable[[Path], None]:
    def plant(folder: Path) -> None:
        weights = torch.load(folder / "model.pt", weights_only=True)
        weights["transformer.ln_f.weight"] = touch(marker)  # not tied: an export reads it
        write_dcp(folder / "sharded", {"model": weights})

    return plant


def a_fifo(folder: Path) -> dict[str, Entry]:
    return {"pipe": fifo(folder / "pipe")}


@pytest.mark.slow
@pytest.mark.timeout(4 * RUN_S)
@pytest.mark.parametrize("kind", ["metadata", "byte entry", "fifo"])
def test_a_planted_checkpoint_is_refused_by_export_and_passed_over_by_resume(
    trained, tmp_path, kind
):
    marker = tmp_path / "PWNED"
    refusal = "qgtrain refuses to unpickle posix.system from "
    plant, said = {
        "metadata": (evil_metadata(marker), refusal),
        "byte entry": (evil_bytes(marker), refusal),
        "fifo": (a_fifo, "pipe is a FIFO (named pipe)"),
    }[kind]
    run = tmp_path / "run"
    shutil.copytree(trained, run, symlinks=True)
    step4, step6 = run / "checkpoints" / "step-4", run / "checkpoints" / "step-6"
    shutil.copytree(step4, step6)
    relist(step6, 6, plant(step6))

    refused = cli(
        "export",
        str(run),
        "--step",
        "6",
        "--out",
        str(tmp_path / "six"),
        cwd=tmp_path,
        timeout=RUN_S,
    )
    assert not marker.exists(), "the export ran the payload"
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("qgtrain: error: export: ") and said in lines[0]
    assert str(step6) in lines[0]

    exported = cli("export", str(run), "--out", str(tmp_path / "hf"), cwd=tmp_path, timeout=RUN_S)
    assert not marker.exists(), "the export ran the payload"
    assert exported.returncode == 0 and f"exported {step4} to" in exported.stdout, exported.stderr
    assert "skipping checkpoint step-6: " in exported.stderr and said in exported.stderr

    args = small_gpt2_run(run, "train.max_steps=6", "checkpoint.every_steps=2")
    resumed = cli(*args, cwd=tmp_path, timeout=RUN_S)
    assert not marker.exists(), "the resume ran the payload"
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    log = (run / "logs" / "rank_0.log").read_text()
    skipped = [line for line in log.splitlines() if "skipping checkpoint step-6: " in line]
    assert len(skipped) == 1 and said in skipped[0], log[-3000:]
    assert "trying the one before it" in skipped[0]
    assert f"resumed from {step4}: step 4" in log
