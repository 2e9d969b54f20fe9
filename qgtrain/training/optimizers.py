"""The optimizer a run trains with: a builder per optim.name, a class by path, or the task's own.

Every optimizer that takes weight_decay gets nanoGPT's grouping: matrices decayed, biases and norm
gains not. Fused kernels are asked for on GPUs where the class has them, as AdamW always was
(parallel/step.py's apply_update then skips a non-finite step on the device). A class named by path
is imported on the ranks, as task.factory is, and its optim.args are checked against its signature
before training.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Collection, Mapping
from typing import Any

import torch
from torch import nn

from ..config import OptimConfig
from ..config.optim import OPTIMIZERS, Builtin, args_problem
from ..foundation.errors import CheckpointError, ConfigError, TaskError, first_line
from ..foundation.factory import load_factory
from ..foundation.task import ReadyTask
from ..state.train_state import TrainState

Builder = Callable[[nn.Module, OptimConfig, torch.device], torch.optim.Optimizer]
ADAMW = "torch.optim.adamw.AdamW"  # what checkpoints of qgtrain before optim.name hold


def build_optimizer(
    task: ReadyTask, optim: OptimConfig, device: torch.device
) -> torch.optim.Optimizer:
    """The task's own optimizer if it brings one, else the one optim.name names."""
    if task.optimizer is None:
        return BUILDERS.get(optim.name, by_path)(task.model, optim, device)
    made = task.optimizer(task.model, optim)
    if not isinstance(made, torch.optim.Optimizer):
        raise TaskError(
            f"task.factory: the task's optimizer returned {type(made).__name__}, not "
            "a torch.optim.Optimizer"
        )
    return made


def name_of(optimizer: torch.optim.Optimizer) -> str:
    return f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"


def check_resumed(state: TrainState, optimizer: torch.optim.Optimizer) -> None:
    """A checkpoint's optimizer state fits only the class that wrote it."""
    saved, now = state.optimizer or ADAMW, name_of(optimizer)
    if saved != now:
        raise CheckpointError(
            f"optim.name: the checkpoint at step {state.step} holds the state of {saved}, not of "
            f"{now}. HINT: resume with the optimizer it was trained with, or start afresh "
            "(checkpoint.resume: never, or another train.run_name)"
        )
    state.optimizer = now


def _groups(model: nn.Module, optim: OptimConfig, decays: bool) -> list[dict[str, Any]]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not decays:
        return [{"params": params}]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": optim.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def _make(
    cls: type,
    model: nn.Module,
    optim: OptimConfig,
    device: torch.device,
    passed: tuple[str, ...],
    takes: tuple[str, ...],
) -> torch.optim.Optimizer:
    given: dict[str, Any] = {"lr": optim.lr, "betas": (optim.beta1, optim.beta2), "eps": optim.eps}
    kwargs = {key: value for key, value in given.items() if key in passed}
    if asks_fused(device.type, takes, optim.args):
        kwargs["fused"] = True
    try:
        made: torch.optim.Optimizer = cls(
            _groups(model, optim, "weight_decay" in passed), **kwargs, **optim.args
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"optim.args: {cls.__qualname__} refused "
            f"{optim.args or 'its arguments'}: {first_line(exc)}"
        ) from None
    return made


def asks_fused(device_type: str, takes: Collection[str], args: Mapping[str, Any]) -> bool:
    """fused=True (one kernel updates every parameter: AdamW's, Adam's, SGD's) on CUDA, where the
    class takes it and optim.args choose no kernel themselves. Elsewhere the default: fused=False
    would also switch off torch's multi-tensor (foreach) kernels, and a CPU run keeps the update,
    to the bit, that its checkpoints were written with."""
    return device_type == "cuda" and "fused" in takes and not {"fused", "foreach"} & set(args)


def builtin(name: str) -> Builder:
    spec: Builtin = OPTIMIZERS[name]

    def build(model: nn.Module, optim: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
        cls = getattr(torch.optim, spec.path.rpartition(".")[2], None)
        if cls is None:
            raise ConfigError(
                f"optim.name: {name} needs {spec.path}, which torch {torch.__version__} lacks"
            )
        return _make(cls, model, optim, device, spec.from_config, spec.takes)

    return build


def muon(model: nn.Module, optim: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """torch's Muon updates matrices only; other parameters need the task's own optimizer."""
    others = [
        (name, tuple(p.shape))
        for name, p in model.named_parameters()
        if p.requires_grad and p.dim() != 2
    ]
    if others:
        shown = ", ".join(f"{name} {shape}" for name, shape in others[:3])
        raise ConfigError(
            f"optim.name: muon (torch.optim.Muon) updates matrices only, and the model has "
            f"{len(others)} trainable parameter(s) of other shapes ({shown}). HINT: give the "
            "task an optimizer (Task.optimizer) that puts them in another one, or choose adamw"
        )
    return builtin("muon")(model, optim, device)


def by_path(model: nn.Module, optim: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """A class named as 'package.module.Name', 'package.module:Name' or 'file.py:Name'."""
    spec = optim.name if ":" in optim.name else ":".join(optim.name.rsplit(".", 1))
    cls = load_factory(spec, "optim.name")
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optim.name: {optim.name!r} is not a torch.optim.Optimizer class")
    parameters = inspect.signature(cls.__init__).parameters
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    takes = tuple(name for name in parameters if name not in ("self", "params"))
    passed = tuple(key for key in ("lr", "betas", "eps", "weight_decay") if key in takes)
    if not any_keyword and (problem := args_problem(optim, Builtin(optim.name, passed, takes))):
        raise ConfigError(f"{problem[0]}: {problem[1]}")
    return _make(cls, model, optim, device, passed, takes)


BUILDERS: dict[str, Builder] = {
    "adamw": builtin("adamw"),
    "adam": builtin("adam"),
    "sgd": builtin("sgd"),
    "adafactor": builtin("adafactor"),
    "muon": muon,
}


def adamw(model: nn.Module, optim: OptimConfig, device: torch.device) -> torch.optim.Optimizer:
    """optim.name: adamw whatever the config names (benchmarks and tests build it directly)."""
    return builtin("adamw")(model, dataclasses.replace(optim, name="adamw", args={}), device)
