"""The optimizers' state and the changes of horizon across real checkpoints: runs SIGKILLed on 2
ranks and resumed bit for bit (ddp and fsdp), and the CLI refusing a longer run that would jump the
learning rate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qgtrain.training.horizon import segment_of
from qgtrain.training.schedule import lr_at
from tests.helpers import TINY, checkpoint_state, cli, records, tiny_config
from tests.ranks import run_ranks, train_rank

KILLABLE = [
    "model.factory=tests.optim_factories:killable",
    "train.max_steps=8",
    "checkpoint.every_steps=4",
    "train.eval_every=4",
    "train.eval_batches=2",
    "optim.warmup_steps=2",
]
CASES = {
    "sgd-fsdp": [
        *KILLABLE,
        "optim.name=sgd",
        "optim.args={momentum: 0.9, nesterov: true}",
        "optim.weight_decay=0.01",
        "optim.schedule=wsd",
        "train.parallel=fsdp",
        "train.shard_modules=[Linear]",
    ],
    "adafactor-ddp": [*KILLABLE, "optim.name=adafactor"],
    "path-fsdp": [
        *KILLABLE,
        "optim.name=torch.optim.RMSprop",
        "optim.args={momentum: 0.5, centered: true}",
        "train.parallel=fsdp",
        "train.shard_modules=[Linear]",
    ],
    "task-ddp": [
        *KILLABLE,
        "task.factory=tests.optim_factories:points_with_own_optimizer",
        "task.options={size: 256}",
        "optim.schedule=linear",
    ],
    "task-fsdp": [
        *KILLABLE,
        "task.factory=tests.optim_factories:points_with_own_optimizer",
        "task.options={size: 256}",
        "train.parallel=fsdp",
        "train.shard_modules=[Linear]",
    ],
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_sigkill_on_two_ranks_then_resume_equals_the_uninterrupted_run(tmp_path, case):
    cfg = tiny_config(*CASES[case])
    reference, killed = str(tmp_path / "reference"), str(tmp_path / "killed")
    assert [r["exit"] for r in run_ranks(2, train_rank, cfg, reference)] == [0, 0]
    with pytest.raises(AssertionError, match="exited"):  # both ranks die in their 7th training step
        run_ranks(2, train_rank, cfg, killed, env={"QGTRAIN_TEST_KILL_AT": "7"})
    assert [r["step"] for r in records(Path(killed))] == list(range(1, 7))
    assert [r["exit"] for r in run_ranks(2, train_rank, cfg, killed)] == [0, 0]
    expected, got = records(Path(reference)), records(Path(killed))
    assert [(r["step"], r["loss"], r["lr"], r.get("val_loss")) for r in got] == [
        (r["step"], r["loss"], r["lr"], r.get("val_loss")) for r in expected
    ]
    want = checkpoint_state(Path(reference, "checkpoints", "step-8"))
    have = checkpoint_state(Path(killed, "checkpoints", "step-8"))
    assert want.keys() == have.keys() and any(k.startswith("optim.") for k in want)
    assert all(torch.equal(tensor, have[name]) for name, tensor in want.items())
    state = json.loads(Path(killed, "checkpoints", "step-8", "state.json").read_text())["trainer"]
    named = {
        "sgd-fsdp": "torch.optim.sgd.SGD",
        "adafactor-ddp": "torch.optim.Adafactor",
        "path-fsdp": "torch.optim.rmsprop.RMSprop",
        "task-ddp": "torch.optim.sgd.SGD",
        "task-fsdp": "torch.optim.sgd.SGD",
    }[case]
    assert state["optimizer"] == named and state["max_steps"] == 8 and state["horizons"] == []
    assert f"optimizer {named}" in Path(killed, "logs", "rank_0.log").read_text()


def fingerprint(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.mark.slow
def test_a_longer_run_is_refused_by_the_cli_unless_wsd_is_flat_or_rewarm_steps_say_how(tmp_path):
    """One cosine run trained to its end at step 8: the CLI refuses 16 steps (exit 2, one line, the
    checkpoints untouched); optim.rewarm_steps then extends it. A wsd run extends from its flat
    phase."""
    every = ["checkpoint.every_steps=4", "train.eval_every=0", "optim.schedule=cosine"]
    run = tmp_path / "run"
    assert (
        run_ranks(1, train_rank, tiny_config("train.max_steps=8", *every), str(run))[0]["exit"] == 0
    )
    checkpoints = fingerprint(run / "checkpoints")
    done = cli(
        "train", "--run-dir", str(run), "--set", *TINY, "train.max_steps=16", *every, cwd=tmp_path
    )
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "qgtrain: error: train.max_steps: changed from 8 to 16 on resume at step 8, which would "
        "move "
        "the learning rate of optim.schedule: cosine from 0.0002 to 0.0011. HINT: keep "
        "train.max_steps: 8, use optim.schedule: wsd (extendable in its flat phase), or set "
        "optim.rewarm_steps: N for a new decay from the current learning rate (N steps up to "
        "optim.lr "
        "first)"
    )
    assert fingerprint(run / "checkpoints") == checkpoints

    sets = ["train.max_steps=16", *every, "optim.rewarm_steps=2"]
    assert run_ranks(1, train_rank, tiny_config(*sets), str(run))[0]["exit"] == 0
    saved = json.loads((run / "checkpoints/step-16/state.json").read_text())
    horizons = saved["trainer"]["horizons"]
    assert horizons == [
        {"step": 8, "from": 8, "to": 16, "lr": pytest.approx(2e-4), "rewarm_steps": 2}
    ]
    optim = tiny_config(*sets).optim
    lrs = {r["step"]: r["lr"] for r in records(run)}
    assert [lrs[s] for s in range(9, 17)] == [
        lr_at(s - 1, optim, 16, segment_of(horizons)) for s in range(9, 17)
    ]
    assert lrs[9] == pytest.approx(2e-4) and lrs[11] == 2e-3  # no jump at the resume; up in 2 steps

    wsd = [
        "optim.schedule=wsd",
        "optim.decay_fraction=0.5",
        "checkpoint.every_steps=2",
        "train.eval_every=0",
    ]
    base = tmp_path / "wsd"
    assert (
        run_ranks(1, train_rank, tiny_config(*wsd, "train.max_steps=8"), str(base))[0]["exit"] == 0
    )
    longer = tiny_config(*wsd, "train.max_steps=16", f"checkpoint.resume={base}/checkpoints/step-4")
    assert run_ranks(1, train_rank, longer, str(tmp_path / "longer"))[0]["exit"] == 0
    lrs = [r["lr"] for r in records(tmp_path / "longer")]
    assert (
        lrs[:5] == [2e-3] * 5 and lrs[-1] < lrs[5] < 2e-3
    )  # flat to step 9 (of 16), then the decay
    logged = (tmp_path / "longer/logs/rank_0.log").read_text()
    assert (
        "train.max_steps changed from 8 to 16 at step 4: the learning rate at step 4 stays"
        in logged
    )
