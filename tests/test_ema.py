"""The EMA of the weights: train.ema_decay, train.eval_ema and `qgtrain export --weights ema`. Runs
against: real training runs (one rank through tests/ranks.py; two ranks of `qgtrain train`, ddp and
fsdp, SIGKILLed and resumed), their checkpoints recomputed in float64, the export loaded by
transformers itself, and the CLI refusing bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import checkpoint_state, cli, records, tiny_config
from tests.ranks import run_ranks, train_rank

DECAY = 0.5  # far from 1: an average that is off by one step, or started elsewhere, is far off too
STEPS = 6


def ema_run(*sets: str):  # type: ignore[no-untyped-def]
    return tiny_config(
        f"train.max_steps={STEPS}",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=10",
        "train.eval_every=2",
        "train.eval_batches=2",
        "optim.lr=0.05",
        *sets,
    )


def train(cfg, run: Path) -> None:  # type: ignore[no-untyped-def]
    result = run_ranks(1, train_rank, cfg, str(run))[0]
    assert result["exit"] == 0, result


def step_files(run: Path, step: int, name: str) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / f"step-{step}" / name, weights_only=True)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same EMA run evaluated on its training weights and on its EMA; and a run without EMA,
    then resumed with it."""
    tmp = tmp_path_factory.mktemp("ema")
    runs = {name: tmp / name for name in ("raw", "eval_ema", "late")}
    train(ema_run(f"train.ema_decay={DECAY}"), runs["raw"])
    train(
        ema_run(f"train.ema_decay={DECAY}", "train.eval_ema=true", "checkpoint.every_steps=0"),
        runs["eval_ema"],
    )  # its final checkpoint is all the comparison needs
    train(ema_run("train.max_steps=2"), runs["late"])
    train(ema_run(f"train.ema_decay={DECAY}", "train.max_steps=3"), runs["late"])
    return runs


def test_the_ema_in_every_checkpoint_equals_the_average_recomputed_from_the_weights(one_rank):
    """From the initial weights (the model rebuilt as training built it), one step of the average
    per optimizer step, in float64: within fp32 rounding of what each checkpoint holds."""
    from qgtrain.ops.export.rebuild import rebuild_task

    run = one_rank["raw"]
    model = rebuild_task(ema_run()).model
    expected = {name: p.detach().double() for name, p in model.named_parameters()}
    for step in range(1, STEPS + 1):
        weights, ema = step_files(run, step, "model.pt"), step_files(run, step, "ema.pt")
        assert ema.keys() == expected.keys() and all(a.dtype == torch.float32 for a in ema.values())
        for name, average in expected.items():
            expected[name] = DECAY * average + (1 - DECAY) * weights[name].double()
            torch.testing.assert_close(ema[name].double(), expected[name], rtol=1e-6, atol=1e-7)
            assert not torch.equal(ema[name], weights[name]), (name, step)


def test_eval_ema_validates_with_the_average_and_leaves_training_exactly_as_it_was(one_rank):
    raw, on_ema = records(one_rank["raw"]), records(one_rank["eval_ema"])
    assert [r["loss"] for r in on_ema] == [r["loss"] for r in raw] and len(raw) == STEPS
    validated = [(a["val_loss"], b["val_loss"]) for a, b in zip(raw, on_ema) if "val_loss" in a]
    assert len(validated) == 3 and all(a != b for a, b in validated), validated
    tested = [
        json.loads((one_rank[name] / "checkpoints" / f"step-{STEPS}" / "state.json").read_text())[
            "trainer"
        ]["test_metrics"]["loss"]
        for name in ("raw", "eval_ema")
    ]
    assert tested[0] != tested[1]
    # The weights put back after each validation are the training weights bit for bit: the run
    # goes on identically, and ends with identical weights, optimizer state and average.
    want = checkpoint_state(one_rank["raw"] / "checkpoints" / f"step-{STEPS}")
    have = checkpoint_state(one_rank["eval_ema"] / "checkpoints" / f"step-{STEPS}")
    assert want.keys() == have.keys() and any(k.startswith("ema.") for k in want)
    assert all(torch.equal(tensor, have[name]) for name, tensor in want.items())


def test_a_run_that_turns_ema_on_as_it_resumes_starts_it_from_the_checkpoints_weights(one_rank):
    run = one_rank["late"]
    assert not (run / "checkpoints" / "step-2" / "ema.pt").exists()  # without EMA: as ever
    log = (run / "logs" / "rank_0.log").read_text()
    assert (
        "holds no EMA of the weights (saved with train.ema_decay 0): the EMA starts from its "
        "weights, those of step 2" in log
    )
    before, after = step_files(run, 2, "model.pt"), step_files(run, 3, "model.pt")
    for name, average in step_files(run, 3, "ema.pt").items():
        expected = DECAY * before[name].double() + (1 - DECAY) * after[name].double()
        torch.testing.assert_close(average.double(), expected, rtol=1e-6, atol=1e-7)


def test_bad_ema_settings_and_exporting_an_ema_that_is_not_there_are_refused_in_one_line(
    one_rank, tmp_path
):
    from qgtrain.config.load import load_config
    from qgtrain.foundation.errors import ConfigError, QgtrainError
    from qgtrain.ops.export.pipeline import export_run

    done = cli("config", "--set", "train.ema_decay=1.0", cwd=tmp_path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "train.ema_decay: 1.0 is outside [0, 1)" in done.stderr
    for value in ("-0.1", "1.5"):
        with pytest.raises(ConfigError, match=rf"train.ema_decay: {value} is outside \[0, 1\)"):
            load_config([], [f"train.ema_decay={value}"])
    with pytest.raises(ConfigError, match="train.eval_ema: needs an EMA of the weights"):
        load_config([], ["train.eval_ema=true"])
    assert load_config([], ["train.ema_decay=0.999"]).train.ema_decay == 0.999
    with pytest.raises(QgtrainError, match="holds no EMA of the weights") as refused:
        export_run(one_rank["late"] / "checkpoints" / "step-2", tmp_path / "out", weights="ema")
    assert refused.value.exit_code == 2 and "\n" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_an_update_not_taken_leaves_the_average_where_it_was():
    """Non-finite gradients skipped on the device, and fp16's GradScaler finding them: the flag
    apply_update returns stops the average in the same call, without the host reading it."""
    from qgtrain.config import TrainConfig
    from qgtrain.runtime.rendezvous import DistEnv
    from qgtrain.training.ema import Ema
    from qgtrain.training.parallel.step import apply_update
    from qgtrain.training.parallel.strategy import strategy_for

    model = torch.nn.Linear(3, 2)
    ema = Ema(model, 0.9, strategy_for(TrainConfig(), DistEnv(), torch.device("cpu")))
    first = {name: a.clone() for name, a in ema.averages.items()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for scaling, bad in ((False, True), (True, True), (True, False)):
        scaler = torch.amp.GradScaler("cpu", enabled=scaling)
        scaler.scale(model(torch.ones(1, 3)).sum() * (float("inf") if bad else 1.0)).backward()
        scaler.unscale_(optimizer)
        skipped = apply_update(optimizer, scaler, torch.tensor(bad and not scaling))
        optimizer.zero_grad()
        assert bool(skipped) == bad
        ema.update(skipped)
        moved = [not torch.equal(first[name], a) for name, a in ema.averages.items()]
        assert moved == [not bad] * 2, (scaling, bad)
