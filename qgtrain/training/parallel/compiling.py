"""model.compile: whether the model is compiled on this device (`compile_plan`, a plain function of
the setting and the environment, tested as a table), and compiling it (`apply`): each repeated
block where the model has them, the whole model otherwise.

Per block (regional compilation, as torchtitan's apply_compile does per TransformerBlock): the
blocks share one code object, so dynamo compiles one block and reuses it for the others, and a
large model compiles in seconds rather than minutes; the step keeps most of the whole-model speed.
Compiling in place (`Module.compile`, which sets `_compiled_call_impl`) leaves the module and its
state-dict keys as they are, and DDP wraps it as it wraps any module (dynamo sees the DDP forward
around it).
Under fsdp and hsdp each block is compiled before it is sharded, as torchtitan applies compile
before fully_shard: FSDP2's hooks run outside the compiled graphs (its _dynamo_disable, "skipping
FSDP hooks", torch/distributed/fsdp/_fully_shard/_fsdp_common.py), which hold the block's forward.

A compile failure surfaces at the first call, not at torch.compile(), so with `auto` each compiled
module's first call is guarded: on an error every module goes back to eager and one line says why.
torch._dynamo.config.suppress_errors is never set: it would hide failures everywhere, for good.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ...foundation.errors import ConfigError
from ...runtime import compile_cache
from . import sharding

log = logging.getLogger("qgtrain")

Setting = bool | str  # model.compile: "auto", True or False


@dataclass(frozen=True)
class CompilePlan:
    compile: bool
    regional: bool  # block by block, not the whole model
    strict: bool  # a failure stops the run (model.compile: true) instead of running eager
    why: str


def compile_plan(
    setting: Setting,
    device_type: str,
    has_blocks: bool = False,
    capability: tuple[int, int] | None = None,
) -> CompilePlan:
    """What model.compile means here, under every layout. `auto` compiles on CUDA only: on the CPU
    inductor's C++ build costs more start than the step gains on the models one trains there, and
    the suite must not compile. Triton, inductor's GPU code generator, needs compute capability 7.0
    (inductor's scheduler raises GPUTooOldForTriton below it)."""
    regional = has_blocks
    if setting is False:
        return CompilePlan(False, False, False, "model.compile: false")
    if setting is True:
        return CompilePlan(True, regional, True, "model.compile: true")
    if device_type != "cuda":
        return CompilePlan(False, False, False, f"model.compile: auto, eager on {device_type}")
    if capability is not None and capability < (7, 0):
        why = f"eager on compute capability {capability[0]}.{capability[1]} (Triton needs 7.0)"
        return CompilePlan(False, False, False, f"model.compile: auto, {why}")
    return CompilePlan(True, regional, False, "model.compile: auto, compiled on cuda")


def repeated_blocks(model: nn.Module, names: Sequence[str]) -> list[nn.Module]:
    """The blocks compiled one by one: those named (train.shard_modules) or the model's
    _no_split_modules (how transformers models name their decoder layers); none where neither
    finds any, and then the whole model is compiled."""
    try:
        return sharding.find_blocks(model, names)
    except ConfigError:
        return []


def apply(
    model: nn.Module, device: torch.device, setting: Setting, blocks: Sequence[nn.Module]
) -> CompilePlan:
    """Compile `model` in place as `compile_plan` decides for `device`; says what it did."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    plan = compile_plan(setting, device.type, bool(blocks), capability)
    if plan.compile:
        compile_cache.claim()
        compile_in_place(list(blocks) if plan.regional else [model], plan.strict)
        where = f"{len(blocks)} {type(blocks[0]).__name__} blocks" if plan.regional else "model"
        log.info("%s: compiling the %s", plan.why, where)
    return plan


@contextlib.contextmanager
def run_eager(model: nn.Module) -> Iterator[None]:
    """Inside, every block compiled in place runs its plain call. Downstream evaluation forwards
    rows of every length and generation's key/value cache, whose update guards on each block's
    layer index: compiled, dynamo would compile each block again up to its recompile limit, for
    forwards that run once per evaluation."""
    compiled = [(m, m._compiled_call_impl) for m in model.modules() if m._compiled_call_impl]
    for module, _ in compiled:
        module._compiled_call_impl = None
    try:
        yield
    finally:
        for module, call in compiled:
            module._compiled_call_impl = call


def compile_in_place(targets: Sequence[nn.Module], strict: bool, backend: Any = "inductor") -> None:
    """Compile each target's call. Each target's first call is watched (_FirstCalls.watch): where
    dynamo quietly leaves blocks eager, one line says so and why. Unless `strict`, a failure at a
    target's first call sends every target back to eager, once, with one line saying why."""
    first = _FirstCalls(targets, strict)
    for target in targets:
        compiled = torch.compile(target._call_impl, backend=backend)
        target._compiled_call_impl = _FirstCall(target, compiled, first)


class _FirstCalls:
    """What the targets' first calls share: strictness, the fall back to eager, and the watch on
    what dynamo made of them."""

    def __init__(self, targets: Sequence[nn.Module], strict: bool) -> None:
        self.targets, self.strict = list(targets), strict
        self.told: set[str] = set()
        self.calls = 0

    def watch(self, call: Callable[[], Any], target: nn.Module) -> Any:
        """Each target's first call. The blocks share their code, so dynamo compiles the first and
        the others reuse its graph; two things it does without a word are told in one line each:
        compiling nothing of the first (it runs eager), and compiling a block again for each
        block until its recompile limit (8), after which the rest run eager."""
        from torch._dynamo.utils import counters  # 1 s to import: only where something compiles

        graphs = counters["stats"]["unique_graphs"]
        seen = set(counters["graph_break"]) | set(counters["unimplemented"])
        out = call()
        self.calls += 1
        new = [r for r in (*counters["unimplemented"], *counters["graph_break"]) if r not in seen]
        why = " ".join(new[0].split()[:40]) if new else "no graph was captured"
        name = type(target).__name__
        if self.calls == 1 and counters["stats"]["unique_graphs"] == graphs:
            self._tell("nothing", f"dynamo compiled nothing of {name}, which runs eager ({why})")
        if any("recompile limit" in r.lower() for r in new):
            self._tell(
                "limit",
                f"dynamo compiled each {name} on its own and stopped at its recompile limit at "
                f"call {self.calls}: the rest run eager (each block's forward differs in "
                "something dynamo guards on, such as an int attribute; TORCH_LOGS=recompiles "
                "says which)",
            )
        return out

    def _tell(self, what: str, line: str) -> None:
        if what not in self.told:
            self.told.add(what)
            log.warning("model.compile: %s", line)

    def to_eager(self, exc: BaseException) -> None:
        if self.targets:
            # dynamo's own line ("backend='inductor' raised:") is followed by the cause's
            first = " ".join([line.strip() for line in str(exc).splitlines() if line.strip()][:2])
            log.warning(
                "model.compile: auto: torch.compile failed (%s: %s); training eager",
                type(exc).__name__,
                first[:300],
            )
        for target in self.targets:
            target._compiled_call_impl = None
        self.targets = []


class _FirstCall:
    """A compiled call until its first success, after which the compiled call replaces it."""

    def __init__(self, target: nn.Module, compiled: Callable[..., Any], first: _FirstCalls) -> None:
        self.target, self.compiled, self.first = target, compiled, first

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            out = self.first.watch(lambda: self.compiled(*args, **kwargs), self.target)
        except Exception as exc:  # noqa: BLE001 torch.compile raises bare Exceptions
            if self.first.strict:
                raise
            self.first.to_eager(exc)
            return self.target._call_impl(*args, **kwargs)
        if self.target._compiled_call_impl is self:
            self.target._compiled_call_impl = self.compiled
        return out
