"""model.compile: the decision as a table (setting x device x blocks), the blocks found in a
transformers model, and the fall back to eager when compiling fails at the first call. Only the
fallback tests compile, with a backend that fails or with dynamo's eager backend: no inductor."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from qgtrain.runtime import compile_cache
from qgtrain.training.parallel import compiling
from qgtrain.training.parallel.compiling import compile_plan


@pytest.mark.parametrize(
    "setting, device, blocks, compiles, regional, strict",
    [
        ("auto", "cuda", True, True, True, False),
        ("auto", "cuda", False, True, False, False),
        ("auto", "cpu", True, False, False, False),
        ("auto", "cpu", False, False, False, False),
        ("auto", "mps", True, False, False, False),
        (True, "cuda", True, True, True, True),
        (True, "cuda", False, True, False, True),
        (True, "cpu", True, True, True, True),
        (True, "cpu", False, True, False, True),
        (False, "cuda", True, False, False, False),
        (False, "cpu", False, False, False, False),
    ],
)
def test_compile_plan_by_setting_device_and_blocks(
    setting, device, blocks, compiles, regional, strict
):
    plan = compile_plan(setting, device, blocks, (9, 0) if device == "cuda" else None)
    assert (plan.compile, plan.regional, plan.strict) == (compiles, regional, strict)
    assert plan.why.startswith(f"model.compile: {str(setting).lower()}")


@pytest.mark.parametrize(
    "capability, compiles", [((7, 0), True), ((9, 0), True), ((6, 1), False), (None, True)]
)
def test_auto_stays_eager_where_triton_cannot_follow(capability, compiles):
    assert compile_plan("auto", "cuda", True, capability).compile is compiles


def test_a_transformers_model_compiles_its_decoder_layers_and_a_plain_model_whole():
    import transformers

    config = transformers.GPT2Config(n_layer=3, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    model = transformers.GPT2LMHeadModel(config)
    blocks = compiling.repeated_blocks(model, ())
    assert blocks == list(model.transformer.h)
    assert compiling.repeated_blocks(nn.Sequential(nn.Linear(2, 2)), ()) == []


def _failing_backend(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
    raise RuntimeError("this backend cannot compile anything")


class _Block(nn.Module):  # torch.nn's own modules are not traced as the frame compiled
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_auto_falls_back_to_eager_with_one_line_when_the_first_call_fails(caplog):
    torch.manual_seed(0)
    model, x = _Blocks(), torch.randn(2, 4)
    expected = model(x)
    compiling.compile_in_place(list(model.layers), strict=False, backend=_failing_backend)
    with caplog.at_level(logging.WARNING, logger="qgtrain"):
        assert torch.equal(model(x), expected)
        assert torch.equal(model(x), expected)
    lines = [r.getMessage() for r in caplog.records if "torch.compile failed" in r.getMessage()]
    assert len(lines) == 1 and "this backend cannot compile anything" in lines[0]
    assert all(layer._compiled_call_impl is None for layer in model.layers)


def test_true_fails_loudly_and_a_compiled_model_computes_what_eager_does():
    torch.manual_seed(0)
    model, x = _Blocks(), torch.randn(2, 4)
    expected = model(x)
    compiling.compile_in_place([model], strict=True, backend=_failing_backend)
    with pytest.raises(Exception, match="this backend cannot compile anything"):
        model(x)
    torch._dynamo.reset()
    again = _Blocks()
    again.load_state_dict(model.state_dict())
    compiling.compile_in_place(list(again.layers), strict=False, backend="eager")
    assert torch.equal(again(x), expected)
    assert all(layer._compiled_call_impl is not None for layer in again.layers)
    assert set(again.state_dict()) == set(model.state_dict())  # no _orig_mod. prefixes
    torch._dynamo.reset()


def test_the_cache_folder_is_made_only_when_something_compiles(tmp_path: Path):
    with compile_cache.in_run_dir(tmp_path, 3) as folder:
        assert not folder.exists()  # model.compile: auto on the CPU compiles nothing
        assert compile_cache.claim() == folder and folder.is_dir()
        assert compile_cache.claim() == folder
    assert compile_cache.claim() is None


def test_blocks_compile_under_lora_and_activation_checkpointing_to_eager_gradients():
    """model.compile composes with the transforms as a run applies them (training/transforms.py:
    LoRA, then each block's forward replaced by its checkpoint; then each block compiled in place):
    dynamo traces peft's layers inside the checkpointed forward (the training forward builds no
    key/value cache, whose update there made dynamo run the blocks eager), and the gradients are
    eager's. Dynamo's eager backend: the graphs are traced, not turned into code."""
    import transformers
    from torch._dynamo.utils import counters

    from qgtrain.config.load import load_config
    from qgtrain.tasks.models import lm_loss
    from qgtrain.training import transforms
    from qgtrain.training.adapters import apply_adapter
    from qgtrain.training.parallel import sharding

    cfg = load_config([], ["model.adapter=lora", "train.activation_checkpointing=true"])
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8, resid_pdrop=0.0
    )
    config.embd_pdrop = config.attn_pdrop = 0.0  # as model.dropout: dynamo draws other masks
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    grads = []
    torch._dynamo.reset()
    counters.clear()
    for compiled in (False, True):
        torch.manual_seed(0)
        model = apply_adapter(transformers.GPT2LMHeadModel(config), cfg)
        blocks = sharding.find_blocks(model, ())
        transforms.checkpoint_activations(blocks)
        if compiled:
            compiling.compile_in_place(blocks, strict=True, backend="eager")
        lm_loss(model, ids).backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    assert counters["stats"]["unique_graphs"] >= 1, "the blocks were traced"
    torch._dynamo.reset()
    assert grads[0].keys() == grads[1].keys() and all("lora_" in n for n in grads[0])
    assert any(bool(g.abs().sum()) for g in grads[0].values())
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad)


class _CheckpointedBlock(_Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self._broken, x, use_reentrant=False)

    def _broken(self, x: torch.Tensor) -> torch.Tensor:
        torch._dynamo.graph_break()  # inside a checkpoint dynamo cannot resume: the call runs eager
        return self.linear(x)


def test_a_block_dynamo_compiles_nothing_of_is_named_in_one_line(caplog):
    torch._dynamo.reset()
    blocks = [_CheckpointedBlock(), _CheckpointedBlock()]
    traced = _Blocks()
    compiling.compile_in_place(blocks, strict=True, backend="eager")
    compiling.compile_in_place(list(traced.layers), strict=True, backend="eager")
    x = torch.randn(2, 4, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="qgtrain"):
        for block in blocks * 2:
            block(x).sum().backward()
        traced(x).sum().backward()
    torch._dynamo.reset()
    lines = [r.getMessage() for r in caplog.records if "compiled nothing" in r.getMessage()]
    assert len(lines) == 1 and "_CheckpointedBlock, which runs eager" in lines[0], lines
    assert "graph_break()" in lines[0], "dynamo's reason"


class _NumberedBlock(_Block):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index  # an int dynamo guards on: each block compiled again

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.index


def test_blocks_compiled_one_by_one_to_the_recompile_limit_are_named_in_one_line(caplog):
    torch._dynamo.reset()
    blocks = [_NumberedBlock(index) for index in range(1, 11)]
    compiling.compile_in_place(blocks, strict=True, backend="eager")
    x = torch.randn(2, 4)
    with caplog.at_level(logging.WARNING, logger="qgtrain"):
        for block in blocks * 2:
            block(x)
    torch._dynamo.reset()
    lines = [r.getMessage() for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(lines) == 1 and "each _NumberedBlock on its own" in lines[0], lines
    assert "at call 9" in lines[0]


def test_the_built_in_lms_blocks_compile_into_one_graph(caplog):
    """A new run's GPT-2 of 12 blocks, forward and backward through the built-in loss: one graph
    for every block, no break. transformers' default key/value cache (the training forward's
    before) guarded on each block's layer index: a compile per block, and past the eighth, eager."""
    from torch._dynamo.utils import counters

    from qgtrain.config import ModelConfig
    from qgtrain.tasks.models import build_model, lm_loss

    torch.manual_seed(0)
    model = build_model(ModelConfig(layers=12, hidden=32, heads=2), 257, 16, None)
    torch._dynamo.reset()
    counters.clear()
    compiling.compile_in_place(compiling.repeated_blocks(model, ()), strict=True, backend="eager")
    with caplog.at_level(logging.WARNING, logger="qgtrain"):
        lm_loss(model, torch.randint(0, 257, (2, 16))).backward()
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["unimplemented"])
    assert not counters["graph_break"] and not caplog.records
    torch._dynamo.reset()


def test_evaluation_runs_the_compiled_blocks_eager_and_training_keeps_its_graph():
    """Generation's key/value cache inside compiled blocks guards on each block's layer index:
    compiled, dynamo would compile each block again up to its recompile limit, for forwards run
    once per evaluation. Under run_eager (downstream evaluation's) nothing compiles, and training's
    graph is there after it."""
    from torch._dynamo.utils import counters

    from qgtrain.config import ModelConfig
    from qgtrain.evals.scoring import cache_argument
    from qgtrain.tasks.models import build_model, lm_loss

    torch.manual_seed(0)
    model = build_model(ModelConfig(layers=12, hidden=32, heads=2), 257, 16, None)
    blocks = compiling.repeated_blocks(model, ())
    ids = torch.randint(0, 257, (2, 8))
    torch._dynamo.reset()
    counters.clear()
    compiling.compile_in_place(blocks, strict=True, backend="eager")
    lm_loss(model, ids).backward()
    with torch.no_grad(), compiling.run_eager(model):
        cache = model(input_ids=ids, use_cache=True)[cache_argument(model)]
        for _ in range(3):
            out = model(input_ids=ids[:, :1], use_cache=True, **{cache_argument(model): cache})
            cache = out[cache_argument(model)]
    assert counters["stats"]["unique_graphs"] == 1 and not counters["unimplemented"]
    lm_loss(model, ids).backward()
    assert counters["stats"]["unique_graphs"] == 1
    assert all(block._compiled_call_impl is not None for block in blocks)
    torch._dynamo.reset()
