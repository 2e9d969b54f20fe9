"""The optim section: the optimizer and schedule a config may name, and their rules.

Torch is not imported here (config load runs on a login node), so the keyword arguments of the
built-in optimizers are written out; tests/test_optimizers.py checks them against torch's own.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .fields import Problem, setting

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass(frozen=True)
class OptimConfig:
    lr: float = setting(2e-3, "peak learning rate", min=0.0)
    min_lr: float = setting(2e-4, "learning rate at the end of the decay", min=0.0)
    warmup_steps: int = setting(50, "steps of linear warmup from 0 to lr", min=0)
    weight_decay: float = setting(
        0.1, "weight decay on matrices, not on biases and norms (optimizers that take one)", min=0.0
    )
    beta1: float = setting(
        0.9, "beta1 of adamw, adam and classes that take betas", min=0.0, max=1.0
    )
    beta2: float = setting(
        0.95, "beta2 of adamw, adam and classes that take betas", min=0.0, max=1.0
    )
    eps: float = setting(1e-8, "epsilon of adamw, adam and classes by path that take eps", min=0.0)
    grad_clip: float = setting(1.0, "clip the global gradient norm to this (0 = off)", min=0.0)
    name: str = setting(
        "adamw",
        "adamw, adam, sgd, adafactor, muon (matrices only, ddp), or an optimizer class "
        "by path: torch.optim.RMSprop, mypkg.opt:Lion, path/to/file.py:Lion",
    )
    args: dict[str, Any] = setting(
        {},
        "further keyword arguments of the optimizer, e.g. {momentum: 0.9, nesterov: true}; "
        "lr, betas, eps and weight_decay come from optim.*",
    )
    schedule: str = setting(
        "cosine",
        "cosine, linear, constant, wsd (warmup, flat at lr, decay at the end), "
        "inverse_sqrt, or 'package.module:function' called with (step, max_steps, optim) "
        "returning the learning rate",
    )
    decay_fraction: float = setting(
        0.2,
        "wsd: the share of train.max_steps at the end over which the learning rate decays "
        "to min_lr, in (0, 1]",
    )
    decay_shape: Literal["linear", "cosine", "sqrt"] = setting(
        "linear",
        "wsd, and a new decay after optim.rewarm_steps: its shape (sqrt: 1 - sqrt(progress))",
    )
    rewarm_steps: int | None = setting(
        None,
        "a resume whose new train.max_steps would change the learning rate: null refuses "
        "it; N >= 0 starts a new decay from the current learning rate, N steps up to optim.lr "
        "first",
        min=0,
    )


@dataclass(frozen=True)
class Builtin:
    path: str  # the torch class
    from_config: tuple[str, ...]  # the keywords qgtrain passes from optim.* (never in optim.args)
    takes: tuple[str, ...]  # every keyword the constructor takes besides params


_ADAM = (
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "amsgrad",
    "maximize",
    "foreach",
    "capturable",
    "differentiable",
    "fused",
)
_ADAM_CONFIG = ("lr", "betas", "eps", "weight_decay")
OPTIMIZERS: dict[str, Builtin] = {
    "adamw": Builtin("torch.optim.AdamW", _ADAM_CONFIG, _ADAM),
    "adam": Builtin("torch.optim.Adam", _ADAM_CONFIG, (*_ADAM, "decoupled_weight_decay")),
    "sgd": Builtin(
        "torch.optim.SGD",
        ("lr", "weight_decay"),
        (
            "lr",
            "momentum",
            "dampening",
            "weight_decay",
            "nesterov",
            "maximize",
            "foreach",
            "differentiable",
            "fused",
        ),
    ),
    "adafactor": Builtin(
        "torch.optim.Adafactor",
        ("lr", "weight_decay"),
        ("lr", "beta2_decay", "eps", "d", "weight_decay", "foreach", "maximize"),
    ),
    "muon": Builtin(
        "torch.optim.Muon",
        ("lr", "weight_decay"),
        (
            "lr",
            "weight_decay",
            "momentum",
            "nesterov",
            "ns_coefficients",
            "eps",
            "ns_steps",
            "adjust_lr_fn",
        ),
    ),
}
SCHEDULES = ("cosine", "linear", "constant", "wsd", "inverse_sqrt")
CONFIG_KEYS = {
    "lr": "optim.lr",
    "betas": "optim.beta1 and optim.beta2",
    "eps": "optim.eps",
    "weight_decay": "optim.weight_decay",
    "params": "the model (or Task.optimizer)",
}


def is_path(name: str) -> bool:
    """'package.module:Name', 'path/to/file.py:Name' or 'package.module.Name'."""
    if ":" in name:
        return name.count(":") == 1 and all(name.split(":"))
    return "." in name.strip(".") and all(name.split("."))


def optim_rules(cfg: RunConfig) -> Problem:
    optim = cfg.optim
    if optim.min_lr > optim.lr:
        return "optim.min_lr", f"{optim.min_lr} is above optim.lr={optim.lr}"
    if optim.name not in OPTIMIZERS and not is_path(optim.name):
        return "optim.name", (
            f"{optim.name!r} is not an optimizer qgtrain knows; choose {', '.join(OPTIMIZERS)}, "
            "or a class by path (torch.optim.RMSprop, mypkg.opt:Lion)"
            + _close(optim.name, OPTIMIZERS)
        )
    if optim.name in OPTIMIZERS and (problem := args_problem(optim, OPTIMIZERS[optim.name])):
        return problem
    if optim.name == "muon" and cfg.train.parallel != "ddp":
        return "optim.name", (
            f"muon orthogonalizes whole matrices, which train.parallel: {cfg.train.parallel} "
            "shards over the ranks; use ddp, or another optimizer"
        )
    if optim.name == "adafactor" and cfg.train.parallel != "ddp":
        return "optim.name", (
            "torch's adafactor cannot step the shards of train.parallel: "
            f"{cfg.train.parallel} (its factored moments reduce over a sharded dimension); "
            "use ddp, or another optimizer"
        )
    if optim.schedule not in SCHEDULES and not (":" in optim.schedule and is_path(optim.schedule)):
        return "optim.schedule", (
            f"{optim.schedule!r} is not a schedule qgtrain knows; choose {', '.join(SCHEDULES)}, "
            "or 'package.module:function' called with (step, max_steps, optim) returning the "
            "learning rate" + _close(optim.schedule, SCHEDULES)
        )
    if not 0.0 < optim.decay_fraction <= 1.0:
        return "optim.decay_fraction", (
            f"{optim.decay_fraction} is outside (0, 1]: it is the share of train.max_steps at "
            "the end over which wsd decays"
        )
    return None


def args_problem(optim: OptimConfig, spec: Builtin) -> Problem:
    """The first optim.args key the optimizer does not take, or that an optim.* key sets already."""
    for key in optim.args:
        if key in spec.from_config or key == "params":
            return f"optim.args.{key}", f"is set by {CONFIG_KEYS[key]}; set it there"
        if key not in spec.takes:
            allowed = ", ".join(k for k in spec.takes if k not in spec.from_config)
            return f"optim.args.{key}", (
                f"{spec.path} takes no argument {key!r}; it takes "
                f"{allowed}" + _close(key, spec.takes)
            )
    return None


def _close(word: str, choices: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f". Did you mean '{close[0]}'?" if close else ""
