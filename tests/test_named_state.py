"""The checkpoint as a table of named parts (state/named.py, training/saved_parts.py): every part
of a trainer saved under its name into today's files and given back to the same objects, and a new
part added by registering it under a name with a place. Runs against: real Trainers at the unit
seam (tests/seam.py) on a one-rank group, and real checkpoints in tmp_path."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from qgtrain.state import layout, named
from qgtrain.state.checkpoint import read_manifest
from qgtrain.state.checkpointer import Why
from qgtrain.state.train_state import Outcome, TrainState
from tests.seam import build_trainer, config, linear_task, one_rank_group

SETS = ("train.max_steps=3", "train.spike_factor=3", "train.ema_decay=0.9")


def test_every_part_is_saved_under_its_name_in_todays_files_and_restored_by_it(tmp_path):
    with one_rank_group():
        trained = build_trainer(tmp_path / "a", linear_task(), config(*SETS))
        assert trained.fit() == Outcome.FINISHED
        folder = tmp_path / "a" / "checkpoints" / "step-3"
        fresh = build_trainer(tmp_path / "b", linear_task(), config(*SETS))
        ckpt = read_manifest(folder)
        assert ckpt is not None
        fresh.restore(ckpt)

    assert list(trained.saved) == [
        "train_state",
        "facts",
        "rng",
        "data",
        "model",
        "optimizer",
        "scaler",
        "ema",
        "spikes",
        "horizon",
    ]
    # the seam's checkpointer has no run files (config.yaml, model.json)
    expected = layout.top_level(1, sharded=False, ema=True, hf_config=False)
    assert {p.name for p in folder.iterdir()} == expected - {layout.CONFIG, layout.MODEL_FACTS}
    saved = json.loads((folder / layout.STATE).read_text())
    assert list(saved) == ["trainer", "precision", "world_size", "versions", "adapter"]
    assert set(saved["trainer"]) == set(TrainState.__dataclass_fields__) | {
        "loss_window",
        "spikes_skipped",
        "max_steps",
        "horizons",
    }
    assert len(saved["trainer"]["loss_window"]) == 3
    own = torch.load(folder / "rank-0.pt", weights_only=True)
    assert list(own) == ["rng", "epoch", "samples_in_epoch"]

    assert fresh.state == trained.state and fresh.state.step == 3
    assert torch.equal(fresh.parallel.model.weight, trained.parallel.model.weight)
    for name in ("optimizer", "spikes", "horizon", "ema"):
        assert _same(fresh.saved[name].state_dict(), trained.saved[name].state_dict()), name


class Counter:
    """A part the checkpoint did not know: a data mixture's draws, say."""

    def __init__(self) -> None:
        self.draws = 0

    def state_dict(self) -> dict[str, Any]:
        return {"draws": torch.tensor(self.draws)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.draws = int(state_dict.get("draws", -1))  # -1: the checkpoint holds none


def test_a_new_part_is_an_object_registered_under_a_name_with_a_place(tmp_path, monkeypatch):
    monkeypatch.setitem(layout.PLACES, "mixture", layout.Place(layout.RANK_FILE, "mixture"))
    with one_rank_group():
        trainer = build_trainer(tmp_path, linear_task(), config(*SETS))
        saver = trainer.parts.checkpointer
        saver.save_parts(1, trainer.saved, {}, Why.STOP)  # a checkpoint from before it
        counter = Counter()
        counter.draws = 7
        saver.save_parts(2, {**trainer.saved, "mixture": counter}, {}, Why.STOP)
        for step, draws in ((2, 7), (1, -1)):
            ckpt = read_manifest(tmp_path / "checkpoints" / f"step-{step}")
            assert ckpt is not None
            loaded = Counter()
            saver.restore(ckpt, {**trainer.saved, "mixture": loaded})
            assert loaded.draws == draws
        own = torch.load(tmp_path / "checkpoints" / "step-2" / "rank-0.pt", weights_only=True)
        assert own["mixture"] == {"draws": torch.tensor(7)}
        with pytest.raises(AssertionError, match="state/layout.py PLACES"):
            named.rank_entries({"unplaced": Counter()})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)
