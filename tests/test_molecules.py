"""The PyTorch Geometric example (jobs/examples/molecules.py) as its users build such models: real
PyG layers (GINConv, BatchNorm, global_mean_pool), PyG Batch objects through collate and .to(), a
dict of outputs. Runs against: real 2-rank `qgtrain train` processes under ddp and fsdp (gloo),
SIGKILLed at a random step and resumed, exported, and loaded back with qgtrain.load_model in this
process, where the whole test split is evaluated at once (one rank, no uneven shards) and must give
the metrics the 2-rank run reported."""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import qgtrain
from qgtrain.config.load import config_from_dict
from qgtrain.foundation.errors import CheckpointError
from qgtrain.ops.export.bundle import resolved
from qgtrain.ops.export.pipeline import export_run
from qgtrain.ops.export.rebuild import rebuild_task
from tests.doc_blocks import python_block
from tests.helpers import EXAMPLE_STEPS as MAX_STEPS
from tests.helpers import checkpoint_state, example, kill_once_saved, records
from tests.ranks import start_cli_ranks, wait_ranks

# jobs/molecules.yaml names the blocks: [GINBlock]
MODES = {"ddp": [], "fsdp": ["train.parallel=fsdp"]}


def train_to_the_end(run: Path, mode: str, cwd: Path, prefix: str) -> None:
    procs = start_cli_ranks(2, example("molecules", run, *MODES[mode]), cwd, log_prefix=prefix)
    codes = wait_ranks(procs, 300)
    assert codes == [0, 0], [(cwd / f"{prefix}-{r}.out").read_text()[-3000:] for r in (0, 1)]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("molecules")
    for mode in MODES:
        train_to_the_end(tmp / mode, mode, tmp, mode)
    return {mode: tmp / mode for mode in MODES}


def saved_state(run: Path, mode: str) -> dict[str, torch.Tensor]:
    """The model (batch norm's buffers included) and optimizer state of the final checkpoint."""
    folder = run / "checkpoints" / f"step-{MAX_STEPS}"
    return checkpoint_state(folder)


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_sigkill_then_resume_equals_the_uninterrupted_run_past_several_checkpoints(
    references, tmp_path, mode
):
    seed = int(os.environ.get("QGTRAIN_TEST_SEED", time.time()))
    kill_at = random.Random(seed).randrange(5, MAX_STEPS - 4)
    run = tmp_path / "killed"
    procs = start_cli_ranks(
        2, example("molecules", run, *MODES[mode]), tmp_path, log_prefix="killed"
    )
    kill_once_saved(run, procs, kill_at)
    train_to_the_end(run, mode, tmp_path, "resumed")

    context = f"({mode}, seed {seed}: killed at step {kill_at})"
    expected, got = records(references[mode]), records(run)
    assert [r["step"] for r in got] == list(range(1, MAX_STEPS + 1)), context
    for want, have in zip(expected, got):
        compared = [k for k in want if k == "loss" or k.startswith(("val_", "test_"))]
        assert {k: have.get(k) for k in compared} == {k: want[k] for k in compared}, (
            f"step {want['step']} {context}"
        )
    assert {"val_ring_accuracy", "test_ring_accuracy", "test_polarity_mae"} <= expected[-1].keys()
    want, have = saved_state(references[mode], mode), saved_state(run, mode)
    assert (
        want.keys() == have.keys()
        and any("running_mean" in k for k in want)
        and any("optim" in k for k in want)
    )
    assert all(torch.equal(want[k], have[k]) for k in want), context
    assert "resumed from" in (run / "logs" / "rank_0.log").read_text(), context
    if mode == "fsdp":
        assert (
            "fsdp: sharding 2 GINBlock blocks and the root over 2 ranks"
            in (tmp_path / "resumed-0.out").read_text()
        )


@pytest.mark.slow
def test_the_exported_model_comes_back_with_load_model_and_gives_the_reported_test_metrics(
    references, tmp_path, monkeypatch
):
    loading = python_block("docs/export.md", 'load_model("models/molecules"')
    for mode, run in references.items():
        out = tmp_path / mode / "models" / "molecules"
        assert export_run(run, out).kind == "state_dict"
        assert {"model.safetensors", "qgtrain_model.json", "README.md"} <= {
            p.name for p in out.iterdir()
        }
        meta = json.loads((out / "qgtrain_model.json").read_text())
        monkeypatch.chdir(tmp_path / mode)  # the export page's lines, as a user pastes them
        pasted: dict[str, object] = {}
        exec(loading, pasted)
        model: Any = pasted["model"]  # the task of jobs/examples, read
        assert not model.training
        assert (
            type(model).__name__ == "MoleculeModel"
            and meta["run"]["ranks"] == 2
            and meta["run"]["parallel"] == mode
        )
        reported = meta["run"]["test"]
        assert reported == {
            k.removeprefix("test_"): v for k, v in records(run)[-1].items() if k.startswith("test_")
        }
        # its task file as the export carries it (named relative to the folder)
        task = rebuild_task(resolved(config_from_dict(meta["config"], "export"), out))
        # all 499 molecules at once
        batch = task.collate([task.test[i] for i in range(len(task.test))])
        with torch.no_grad():
            loss, got = float(task.loss(model, batch)), task.metrics(model, batch)
        assert int(got["ring_accuracy"][0]) / len(task.test) == reported["ring_accuracy"], mode
        assert loss == pytest.approx(reported["loss"], rel=1e-5), mode
        assert float(got["polarity_mae"][0]) / len(task.test) == pytest.approx(
            reported["polarity_mae"], rel=1e-5
        )

    other = tmp_path / "other"
    shutil.copytree(tmp_path / "ddp" / "models" / "molecules", other)
    save_file(torch.nn.Linear(4, 2).state_dict(), other / "model.safetensors")
    with pytest.raises(CheckpointError) as refused:
        qgtrain.load_model(other, trust_code=True)
    said = str(refused.value)
    assert refused.value.exit_code == 2 and "\n" not in said
    assert (
        f"load_model: the weights in {other} (of a " in said
        and "MoleculeModel) do not fit the " in said
    )
    assert "not in the folder: embed.weight, blocks.0.conv.eps, blocks.0.conv.nn.0.weight" in said
    assert "not in the model: bias, weight" in said
