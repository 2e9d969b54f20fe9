"""The built-in language model as fast as its shape allows, for new runs only (issue 47): the fused
tanh GELU, SDPA, the vocabulary padded to 64 rows yet never predicted, weights drawn once; exported
unpadded; a checkpoint written before rebuilt as it was; fused AdamW on CUDA. Runs against: real
transformers models, the committed run directory of commit 26ab7a7 (tests/data, as
test_old_checkpoint.py resumes it), a real one-rank training run exported and reloaded by
transformers, and real torch optimizers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from qgtrain.config import ModelConfig
from qgtrain.config.load import load_config
from qgtrain.config.optim import OPTIMIZERS
from qgtrain.foundation.task import ReadyTask
from qgtrain.ops.export import origin
from qgtrain.ops.export.pipeline import export_run
from qgtrain.runtime import rng
from qgtrain.state import checkpoint
from qgtrain.state.weights import strip_wrapper_prefixes
from qgtrain.tasks import lm_shape, warm_imports
from qgtrain.tasks.build import build_task
from qgtrain.tasks.models import build_model, lm_loss
from qgtrain.training.optimizers import asks_fused, build_optimizer
from tests.helpers import byte_config
from tests.ranks import run_ranks, train_rank

OLD_STEP_4 = (
    Path(__file__).parent / "data" / "checkpoint-26ab7a7" / "run" / "checkpoints" / "step-4"
)
TINY_LM = ModelConfig(layers=1, heads=2, hidden=16)


def activation_of(model: nn.Module) -> str:
    return type(model.transformer.h[0].mlp.act).__name__  # type: ignore[union-attr,index]


def test_a_new_gpt2_gets_the_fused_gelu_sdpa_and_64_rows_but_predicts_the_real_vocab_only():
    rng.seed_everything(0)
    model = build_model(TINY_LM, 257, 16, 256)
    assert lm_shape.facts_of(model) == {
        "activation": "gelu_pytorch_tanh",
        "padded_vocab": 320,
        "attention": "sdpa",
        "init": "once",
    }
    assert activation_of(model) == "GELUTanh" and model.config._attn_implementation == "sdpa"
    assert model.get_input_embeddings().num_embeddings == 320
    tokens = torch.randint(0, 257, (2, 16))
    assert model(input_ids=tokens).logits.shape == (2, 16, 257)
    # an architecture without gelu_new keeps its activation; its vocabulary is padded all the same
    llama = build_model(ModelConfig(arch="llama", layers=1, heads=2, hidden=16), 257, 16, 256)
    assert lm_shape.facts_of(llama)["activation"] == "silu"
    assert llama.get_output_embeddings().out_features == 320


def test_the_padded_model_gives_the_logits_and_losses_of_its_rows_of_the_real_vocab():
    """The padded rows count nowhere: lm_loss, a loss asked for with labels, and a tuple output
    all equal those of the same weights without them."""
    rng.seed_everything(0)
    padded = build_model(TINY_LM, 257, 16, 256).eval()
    unpadded_shape = lm_shape.LMShape(None, True, None, 1, "sdpa", True)
    unpadded = build_model(TINY_LM, 257, 16, 256, unpadded_shape).eval()
    unpadded.load_state_dict(
        {k: v[:257] if len(v) == 320 else v for k, v in padded.state_dict().items()}
    )
    tokens = torch.randint(0, 257, (3, 16))
    with torch.no_grad():
        cut, real = (
            padded(input_ids=tokens, labels=tokens),
            unpadded(input_ids=tokens, labels=tokens),
        )
        assert torch.equal(cut.logits, real.logits) and torch.equal(cut.loss, real.loss)
        as_tuple = padded(input_ids=tokens, labels=tokens, return_dict=False)
        assert torch.equal(as_tuple[0], real.loss) and torch.equal(as_tuple[1], real.logits)
        assert torch.equal(lm_loss(padded, tokens), lm_loss(unpadded, tokens))
        # over 320 columns the loss would differ: the padded rows' logits are not -inf
        full = torch.nn.functional.linear(
            padded.transformer(input_ids=tokens).last_hidden_state, padded.lm_head.weight
        )
        assert full.shape[-1] == 320 and not torch.equal(
            full[..., :257].logsumexp(-1), full.logsumexp(-1)
        )


def test_weights_are_drawn_once_from_the_seed_and_an_old_shape_draws_as_before():
    """The same seed gives the same weights; every weight is drawn (no NaN from the skipped
    constructor draws); the legacy shape is transformers' own from_config, bit for bit (a LoRA
    run's seeded base is drawn again on every start)."""
    import transformers

    builds = []
    for _ in range(2):
        rng.seed_everything(3)
        builds.append(build_model(TINY_LM, 257, 16, 256).state_dict())
    assert all(torch.equal(builds[0][k], builds[1][k]) for k in builds[0])
    assert not any(v.isnan().any() for v in builds[0].values())
    assert 0.015 < float(builds[0]["transformer.h.0.mlp.c_fc.weight"].std()) < 0.025
    rng.seed_everything(3)
    legacy = build_model(TINY_LM, 257, 16, 256, lm_shape.LEGACY).state_dict()
    rng.seed_everything(3)
    config = byte_config("gpt2", n_embd=16, n_layer=1, n_positions=16, pad_token_id=None)
    for name in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
        setattr(config, name, 0.0)
    plain = transformers.AutoModelForCausalLM.from_config(config).state_dict()
    assert all(torch.equal(legacy[k], plain[k]) for k in plain)


def test_a_checkpoint_written_before_is_rebuilt_with_its_old_model():
    """26ab7a7's checkpoint (model facts without the new keys): the task built to resume it has
    gelu_new and 257 rows, and its weights load strictly; a new run's build would not fit them."""
    cfg = origin.yaml_config(checkpoint.read_manifest(OLD_STEP_4))
    weights = strip_wrapper_prefixes(torch.load(OLD_STEP_4 / "model.pt", weights_only=True))
    rng.seed_everything(cfg.train.seed)
    resumed = build_task(cfg, resumed_from=OLD_STEP_4)
    assert activation_of(resumed.model) == "NewGELUActivation"
    assert resumed.model.get_input_embeddings().num_embeddings == 257
    resumed.model.load_state_dict(weights)
    assert resumed.facts["padded_vocab"] == 257 and resumed.facts["init"] == "full"
    # those facts, recorded in its next checkpoint, rebuild the same model again
    again = build_model(cfg.model, 257, 16, 256, lm_shape.from_facts(resumed.facts))
    again.load_state_dict(weights)
    assert activation_of(again) == "NewGELUActivation"
    new = build_task(cfg)
    assert new.model.get_input_embeddings().num_embeddings == 320
    with pytest.raises(RuntimeError, match="size mismatch"):
        new.model.load_state_dict(weights)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("padded")
    cfg = load_config(
        [],
        [
            "data.name=synthetic",
            "data.seq_len=16",
            "data.synthetic_samples=64",
            "model.layers=1",
            "model.heads=2",
            "model.hidden=16",
            "train.batch_size=4",
            "train.max_steps=6",
            "train.eval_every=3",
            "train.eval_batches=1",
            "train.ema_decay=0.5",
            "checkpoint.every_steps=3",
            "logging.tensorboard=false",
            "data.num_workers=0",
            "optim.warmup_steps=0",
        ],
    )
    assert run_ranks(1, train_rank, cfg, str(tmp / "run"))[0]["exit"] == 0
    return tmp / "run"


def trained_model(ckpt_dir: Path) -> ReadyTask:
    """The model as the run trained it (its forward cutting the padded rows), with the
    checkpoint's weights."""
    cfg = origin.yaml_config(checkpoint.read_manifest(ckpt_dir))
    task = build_task(cfg, resumed_from=ckpt_dir)
    task.model.load_state_dict(
        strip_wrapper_prefixes(torch.load(ckpt_dir / "model.pt", weights_only=True))
    )
    return task


@pytest.mark.parametrize("weights", ["model", "ema"])
def test_the_export_loads_in_transformers_with_the_real_vocab_and_the_trained_logits(
    trained, tmp_path, weights
):
    import transformers

    done = export_run(trained, tmp_path / "out", weights=weights)
    task = trained_model(done.checkpoint)
    assert task.facts["padded_vocab"] == 320 and task.facts["vocab_size"] == 257
    assert task.model.get_input_embeddings().num_embeddings == 320
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert reloaded.config.vocab_size == len(tokenizer) == 257
    assert reloaded.config.activation_function == "gelu_pytorch_tanh"
    tokens = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        got = reloaded(input_ids=tokens).logits
        if weights == "model":
            assert torch.equal(got, task.model.eval()(input_ids=tokens).logits)
        else:  # the EMA's rows of the real vocabulary, not the trained weights'
            assert not torch.allclose(got, task.model.eval()(input_ids=tokens).logits)
            assert got.shape == (2, 16, 257)


@pytest.mark.parametrize(
    ("device", "name", "args", "fused"),
    [
        ("cuda", "adamw", {}, True),
        ("cuda", "adam", {}, True),
        ("cuda", "adamw", {"foreach": True}, False),  # the user's choice of kernel
        ("cuda", "adamw", {"fused": False}, False),
        ("cuda", "adafactor", {}, False),  # no fused kernel to ask for
        ("cpu", "adamw", {}, False),  # a CPU run keeps its update to the bit
        ("mps", "adamw", {}, False),
    ],
)
def test_fused_adamw_is_asked_for_on_cuda_only(device, name, args, fused):
    assert asks_fused(device, OPTIMIZERS[name].takes, args) is fused


def test_the_optimizer_built_for_cuda_is_fused_and_for_the_cpu_is_not():
    """Built for real (torch's fused AdamW also runs on CPU tensors, so no GPU is needed to build
    it): the decision reaches the optimizer."""
    model = nn.Linear(4, 4)
    task = ReadyTask(model=model, train=[0], val=None, test=None, loss=lm_loss, collate=list)
    optim = load_config([], []).optim
    built = {
        device: build_optimizer(task, optim, torch.device(device)).param_groups[0]["fused"]
        for device in ("cuda", "cpu")
    }
    assert built == {"cuda": True, "cpu": None}


def test_qgtrain_train_imports_the_built_in_models_modeling_in_the_background():
    """A thread imports the architecture's modeling module and the task build joins it; a task's
    own model starts nothing (it may never import transformers)."""
    warm_imports.start(load_config([], ["task.factory=tests.tasks:points"]))
    assert not warm_imports._started
    warm_imports.start(load_config([], ["model.arch=opt"]))
    (thread,) = warm_imports._started
    assert thread.name == "qgtrain-imports" and thread.daemon
    warm_imports.wait()
    assert not warm_imports._started and not thread.is_alive()
    assert "transformers.models.opt.modeling_opt" in sys.modules


@pytest.mark.parametrize(
    "facts, keeps",
    [
        (None, False),
        ({}, True),
        ({"training_cache": True}, True),
        ({"training_cache": False}, False),
    ],
)
def test_only_a_run_begun_before_keeps_the_training_forwards_cache(facts, keeps):
    """A new run (no facts) asks for no key/value cache; one resumed from a checkpoint whose facts
    predate the choice keeps transformers' default, bit for bit (test_old_checkpoint.py)."""
    with lm_shape.resuming(facts):
        assert lm_shape.keeps_default_cache() is keeps
