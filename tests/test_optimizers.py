"""optim.name, optim.schedule and the guard on a changed train.max_steps: the schedules' corners,
the decisions on a resume, the optimizers' state across a checkpoint, and bad input refused at
load."""

from __future__ import annotations

import dataclasses
import inspect
import io
import math

import pytest
import torch
from torch import nn

from qgtrain.config import OptimConfig
from qgtrain.config.load import load_config
from qgtrain.config.optim import OPTIMIZERS
from qgtrain.foundation.errors import ConfigError
from qgtrain.state.train_state import TrainState
from qgtrain.training.horizon import LearningRate, segment_of
from qgtrain.training.optimizers import BUILDERS, by_path
from qgtrain.training.schedule import lr_at
from tests.helpers import cli

CPU = torch.device("cpu")
BASE = OptimConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, decay_fraction=0.2)


def test_the_keywords_written_out_for_the_builtins_are_torchs():
    """Config load cannot import torch, so the table is written out; it must not drift."""
    for name, spec in OPTIMIZERS.items():
        cls = getattr(torch.optim, spec.path.rpartition(".")[2])
        parameters = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        assert set(spec.takes) == parameters, name


# (schedule, extra settings, step, lr): warmup end at step 9, cosine/linear decay from 10 to 100,
# wsd flat until step 80 (the last 0.2 of 100), inverse_sqrt independent of max_steps.
CORNERS = [
    ("cosine", {}, 0, 1e-4),
    ("cosine", {}, 9, 1e-3),
    ("cosine", {}, 10, 1e-3),
    ("cosine", {}, 55, 5.5e-4),
    ("cosine", {}, 99, 1e-4 + 0.5 * (1 + math.cos(math.pi * 89 / 90)) * 9e-4),
    ("cosine", {}, 100, 1e-4),
    ("linear", {}, 9, 1e-3),
    ("linear", {}, 10, 1e-3),
    ("linear", {}, 55, 5.5e-4),
    ("linear", {}, 100, 1e-4),
    ("constant", {}, 0, 1e-4),
    ("constant", {}, 9, 1e-3),
    ("constant", {}, 100, 1e-3),
    ("wsd", {}, 9, 1e-3),
    ("wsd", {}, 79, 1e-3),
    ("wsd", {}, 80, 1e-3),
    ("wsd", {}, 90, 5.5e-4),
    ("wsd", {}, 99, 1e-4 + 0.05 * 9e-4),
    ("wsd", {}, 100, 1e-4),
    ("wsd", {"decay_shape": "cosine"}, 90, 5.5e-4),
    ("wsd", {"decay_shape": "sqrt"}, 85, 5.5e-4),
    ("wsd", {"decay_fraction": 1.0}, 10, 1e-3),
    ("wsd", {"decay_fraction": 1.0}, 55, 5.5e-4),
    ("inverse_sqrt", {}, 9, 1e-3),
    ("inverse_sqrt", {}, 39, 5e-4),
    ("inverse_sqrt", {}, 10**6, 1e-4),
    ("tests.optim_factories:halving", {}, 24, 1e-3),
    ("tests.optim_factories:halving", {}, 25, 5e-4),
]


@pytest.mark.parametrize("schedule, extra, step, expected", CORNERS)
def test_each_schedule_at_its_corners(schedule, extra, step, expected):
    optim = dataclasses.replace(BASE, schedule=schedule, **extra)
    assert lr_at(step, optim, 100) == pytest.approx(expected, rel=1e-12)


def test_cosine_is_todays_schedule_value_for_value():
    def today(
        step: int, optim: OptimConfig, max_steps: int
    ) -> float:  # qgtrain 0.x's lr_at, verbatim
        if optim.warmup_steps and step < optim.warmup_steps:
            return optim.lr * (step + 1) / optim.warmup_steps
        progress = min(
            max(step - optim.warmup_steps, 0) / max(max_steps - optim.warmup_steps, 1), 1.0
        )
        return optim.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (optim.lr - optim.min_lr)

    assert all(lr_at(s, OptimConfig(), 600) == today(s, OptimConfig(), 600) for s in range(601))


def resumed(
    schedule: str, step: int, old: int, new: int, **extra: object
) -> tuple[TrainState, LearningRate]:
    optim = dataclasses.replace(BASE, schedule=schedule, **extra)
    state = TrainState(step=step)
    rate = LearningRate(
        optim, new, torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=optim.lr), state
    )
    rate.load_state_dict({"max_steps": old, "horizons": []})  # the checkpoint's "horizon"
    return state, rate


@pytest.mark.parametrize(
    "schedule, step",
    [("wsd", 40), ("wsd", 80), ("cosine", 5), ("constant", 90), ("inverse_sqrt", 90)],
)
def test_a_longer_run_that_keeps_the_learning_rate_moves_the_end(schedule, step):
    state, rate = resumed(schedule, step, 100, 200)
    assert rate.at(state) == lr_at(step, rate.optim, 100)
    assert rate.state_dict() == {
        "max_steps": 200,
        "horizons": [
            {"step": step, "from": 100, "to": 200, "lr": rate.at(state), "rewarm_steps": None}
        ],
    }


@pytest.mark.parametrize(
    "schedule, step", [("wsd", 90), ("cosine", 50), ("cosine", 100), ("linear", 20)]
)
def test_a_longer_run_that_would_jump_the_learning_rate_is_refused(schedule, step):
    with pytest.raises(ConfigError) as refused:
        resumed(schedule, step, 100, 200)
    said = str(refused.value)
    assert said.startswith(f"train.max_steps: changed from 100 to 200 on resume at step {step}")
    assert "optim.rewarm_steps" in said and "optim.schedule: wsd" in said and "\n" not in said
    with pytest.raises(ConfigError, match="train.max_steps: 50 is below step 60"):
        resumed(schedule, 60, 100, 50)


def test_rewarm_steps_start_a_new_decay_from_the_current_rate_kept_across_checkpoints():
    state, rate = resumed("cosine", 100, 100, 200, rewarm_steps=10)
    at = {s: lr_at(s, rate.optim, 200, segment_of(rate.horizons)) for s in range(100, 201)}
    assert at[100] == pytest.approx(1e-4) and at[105] == pytest.approx(5.5e-4) and at[110] == 1e-3
    assert at[155] == pytest.approx(5.5e-4) and at[200] == pytest.approx(1e-4)
    assert all(at[s] >= at[s + 1] for s in range(110, 200))
    again = LearningRate(rate.optim, 200, rate.optimizer, state)
    again.load_state_dict(rate.state_dict())  # as a checkpoint's "horizon" restores it
    assert segment_of(again.horizons) == segment_of(rate.horizons)
    assert again.horizons == rate.horizons
    # Without a rewarm the new decay goes on from where the rate was, to min_lr at the new end.
    state, rate = resumed("cosine", 50, 100, 200, rewarm_steps=0)
    assert lr_at(50, rate.optim, 200, segment_of(rate.horizons)) == lr_at(50, rate.optim, 100)
    assert lr_at(200, rate.optim, 200, segment_of(rate.horizons)) == pytest.approx(1e-4)


def test_a_group_built_with_its_own_rate_keeps_its_ratio_to_optim_lr():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    optimizer = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": BASE.lr / 10}],
        lr=BASE.lr,
    )
    rate = LearningRate(BASE, 100, optimizer, TrainState(step=50))
    lr = rate.set(TrainState(step=50))
    assert [g["lr"] for g in optimizer.param_groups] == [lr, pytest.approx(lr / 10)]


def matrices() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8, bias=False), nn.Tanh(), nn.Linear(8, 3, bias=False))


def steps(model: nn.Module, optimizer: torch.optim.Optimizer, count: int) -> None:
    for i in range(count):
        optimizer.zero_grad()
        model(torch.linspace(-1, 1, 8 * (i + 1))[-8:].reshape(2, 4)).square().sum().backward()
        optimizer.step()


@pytest.mark.parametrize(
    "name, args",
    [
        ("adamw", {}),
        ("adam", {"amsgrad": True}),
        ("muon", {}),
        ("adafactor", {}),
        ("torch.optim.RMSprop", {"momentum": 0.5}),
    ],
)
def test_state_saved_after_two_steps_gives_the_same_third_step(name, args):
    optim = dataclasses.replace(BASE, name=name, args=args)
    build = BUILDERS.get(name, by_path)
    model, optimizer = matrices(), None
    optimizer = build(model, optim, CPU)
    steps(model, optimizer, 2)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "optim": optimizer.state_dict()}, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)
    other = matrices()
    other.load_state_dict(loaded["model"])
    resumed_optimizer = build(other, optim, CPU)
    resumed_optimizer.load_state_dict(loaded["optim"])
    steps(model, optimizer, 1)
    steps(other, resumed_optimizer, 1)
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True)
    )


def test_adamw_is_built_as_before_and_muon_refuses_what_it_cannot_update():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    built = BUILDERS["adamw"](model, OptimConfig(), CPU)
    before = torch.optim.AdamW(
        [
            {"params": [model[0].weight], "weight_decay": 0.1},
            {"params": [model[0].bias, *model[1].parameters()], "weight_decay": 0.0},
        ],
        lr=2e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    assert built.state_dict() == before.state_dict()
    with pytest.raises(ConfigError, match=r"muon .* 3 trainable parameter\(s\) of other shapes"):
        BUILDERS["muon"](model, dataclasses.replace(BASE, name="muon"), CPU)
    with pytest.raises(
        ConfigError, match="optim.args.betas: torch.optim.RMSprop takes no argument 'betas'"
    ):
        by_path(
            model, dataclasses.replace(BASE, name="torch.optim.RMSprop", args={"betas": 1}), CPU
        )


@pytest.mark.parametrize(
    "assignment, key",
    [
        ("optim.name=adamx", "optim.name: 'adamx' is not an optimizer qgtrain knows"),
        ("optim.schedule=cosin", "optim.schedule: 'cosin' is not a schedule qgtrain knows"),
        ("optim.args={momentun: 0.9}", "optim.args.momentun: torch.optim.AdamW takes no argument"),
        ("optim.args={lr: 0.1}", "optim.args.lr: is set by optim.lr"),
        ("optim.decay_fraction=0", "optim.decay_fraction: 0.0 is outside (0, 1]"),
        ("optim.decay_fraction=1.5", "optim.decay_fraction: 1.5 is outside (0, 1]"),
        ("optim.rewarm_steps=-1", "optim.rewarm_steps: -1 is out of range"),
    ],
)
def test_bad_optim_settings_are_refused_at_load(assignment, key):
    with pytest.raises(
        ConfigError, match=key.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
    ):
        load_config([], [assignment])
    with pytest.raises(ConfigError, match="muon orthogonalizes whole matrices"):
        load_config([], ["optim.name=muon", "train.parallel=fsdp"])
    with pytest.raises(ConfigError, match="torch's adafactor cannot step the shards"):
        load_config([], ["optim.name=adafactor", "train.parallel=hsdp"])


def test_the_cli_refuses_an_argument_the_optimizer_does_not_take_in_one_line(tmp_path):
    done = cli("config", "--set", "optim.name=sgd", "optim.args={momentun: 0.9}", cwd=tmp_path)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines() == [
        "qgtrain: error: --set: optim.args.momentun: torch.optim.SGD takes no argument "
        "'momentun'; it takes momentum, dampening, nesterov, maximize, foreach, differentiable, "
        "fused. Did you mean "
        "'momentum'?"
    ]
