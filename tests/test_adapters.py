"""LoRA adapters (model.adapter: lora) on a small Llama saved by the test as the pretrained base:
two gloo ranks train the adapters only; a SIGKILLed run resumes bit for bit; checkpoints hold the
adapters, not the base; the PEFT adapter export and the merged export compute the same logits; fsdp
(with activation checkpointing, resumed from its sharded checkpoint) trains the adapters ddp trains,
bit for bit;
a checkpoint resumed onto another base, unknown target modules and rank 0 are refused in one line;
on the built-in GPT-2 (drawn from train.seed) only the merged export is written. The merged export
of a pretrained folder is streamed from its safetensors: peft's merge_and_unload weights, for Llama
and for a sharded GPT-2 (Conv1D, a tied lm_head) exported by export.on_finish with export.merge,
which a seeded base needs (refused at config load without it)."""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.doc_blocks import python_block
from tests.helpers import (
    byte_config,
    checkpoint_state,
    cli,
    kill_once_saved,
    records,
    train_command,
)
from tests.ranks import ROOT, run_ranks, start_cli_ranks, train_rank, wait_ranks

STEPS = 16
# lm_head among the targets: on a random base, only it learns the corpus's bytes within 16 steps
LORA = [
    "model.adapter=lora",
    "model.lora_rank=4",
    "model.lora_targets=[q_proj, v_proj, lm_head]",
    "data.corpus_mb=0.1",
    "data.seq_len=32",
    "train.batch_size=8",
    "train.log_every=1",
    "train.eval_every=2",
    "train.eval_batches=2",
    "checkpoint.every_steps=4",
    "optim.warmup_steps=0",
    "optim.lr=0.05",
    "optim.schedule=constant",
    "logging.tensorboard=false",
    "model.lora_dropout=0.1",
    "train.ema_decay=0.9",  # the adapters' EMA: resumed bit for bit, exported with --weights ema
    # No clipping: its norm is summed per shard under fsdp and whole under ddp, an order that moves
    # its last bit, and so the clipped gradients', which Adam at this rate carries into the adapters
    # (1e-4 apart after 16 steps on some CPUs). Unclipped, fsdp's arithmetic is ddp's, bit for bit.
    "optim.grad_clip=0",
]


def save_llama(folder: Path, seed: int) -> Path:
    import transformers

    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(byte_config("llama")).save_pretrained(folder)
    return folder


def settings(base: Path, *sets: str) -> list[str]:
    return [
        *LORA,
        f"model.pretrained={base}",
        f"data.cache_dir={base.parent / 'data'}",
        f"train.max_steps={STEPS}",
        *sets,
    ]


def train(run: Path, sets: list[str]) -> None:
    from qgtrain.config.load import load_config

    cfg = load_config([ROOT / "config.yaml"], sets)
    assert [r["exit"] for r in run_ranks(2, train_rank, cfg, str(run))] == [0, 0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The base, the ddp run, the same run SIGKILLed and resumed, and an fsdp run stopped at step 8
    and resumed from its sharded checkpoint."""
    tmp = tmp_path_factory.mktemp("adapters")
    base = save_llama(tmp / "base", 0)
    train(tmp / "ddp", settings(base))
    train(
        tmp / "fsdp",
        settings(
            base, "train.parallel=fsdp", "train.activation_checkpointing=true", "train.max_steps=8"
        ),
    )
    train(
        tmp / "fsdp", settings(base, "train.parallel=fsdp", "train.activation_checkpointing=true")
    )
    seed = int(os.environ.get("QGTRAIN_TEST_SEED", time.time()))
    kill_at = random.Random(seed).randrange(5, 11)
    killed = tmp / "killed"
    args = [
        "train",
        "--config",
        str(ROOT / "config.yaml"),
        "--run-dir",
        str(killed),
        "--set",
        *settings(base),
    ]
    procs = start_cli_ranks(2, args, tmp, log_prefix="killed")
    kill_once_saved(killed, procs, kill_at)
    assert not (killed / "checkpoints" / f"step-{STEPS}").exists(), f"killed too late (seed {seed})"
    assert wait_ranks(start_cli_ranks(2, args, tmp, log_prefix="killed"), 120) == [0, 0]
    return {"base": base, "ddp": tmp / "ddp", "fsdp": tmp / "fsdp", "killed": killed, "tmp": tmp}


def final(run: Path) -> dict[str, torch.Tensor]:
    return checkpoint_state(run / "checkpoints" / f"step-{STEPS}")


def test_lora_trains_the_adapters_only_and_checkpoints_hold_only_them(runs):
    losses = [r["loss"] for r in records(runs["ddp"]) if "loss" in r]
    assert len(losses) == STEPS and sum(losses[-4:]) < 0.9 * sum(losses[:4])
    state = final(runs["ddp"])
    weights = [k for k in state if k.startswith("model.")]
    assert len(weights) == 2 * (2 * 2 + 1) and all(
        ".lora_A.default." in k or ".lora_B.default." in k for k in weights
    )
    # the optimizer holds the adapters' moments only: nothing else can have moved
    assert {k.split(".")[1] for k in state if k.startswith("optim.")} == {
        str(i) for i in range(len(weights))
    }
    assert any(state[k].abs().sum() > 0 for k in weights if ".lora_B." in k)
    ckpt = runs["ddp"] / "checkpoints" / f"step-{STEPS}"
    held = sum((ckpt / name).stat().st_size for name in ("model.pt", "optim.pt"))
    assert held * 3 < (runs["base"] / "model.safetensors").stat().st_size


def test_sigkill_then_resume_equals_the_uninterrupted_run_bit_for_bit(runs):
    expected, got = records(runs["ddp"]), records(runs["killed"])
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got] == [r["loss"] for r in expected]
    want, have = final(runs["ddp"]), final(runs["killed"])
    assert want.keys() == have.keys() and all(torch.equal(t, have[k]) for k, t in want.items())
    assert "resumed from" in (runs["killed"] / "logs" / "rank_0.log").read_text()


def test_fsdp_resumed_from_its_shards_trains_the_adapters_ddp_trains(runs):
    assert (runs["fsdp"] / "checkpoints" / f"step-{STEPS}" / "sharded").is_dir()
    expected, got = records(runs["ddp"]), records(runs["fsdp"])
    assert [r["step"] for r in got if "loss" in r] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in got if "loss" in r] == [r["loss"] for r in expected if "loss" in r]
    want, have = final(runs["ddp"]), final(runs["fsdp"])
    adapters = [k for k in want if k.startswith("model.")]  # the shards hold the adapters, no base
    assert adapters == [k for k in have if k.startswith("model.")]
    assert all(torch.equal(want[k], have[k]) for k in adapters)


def test_adapter_export_loads_with_peft_and_equals_the_merged_export(runs, tmp_path, monkeypatch):
    """The merged export, streamed from the base's safetensors, holds peft's merge_and_unload
    weights and computes the adapter export's logits. Both folders are exported and loaded as the
    fine-tuning page says (its base's path is this run's)."""
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file

    adapter, merged = tmp_path / "models" / "lora-adapter", tmp_path / "models" / "lora-merged"
    for out, extra in ((adapter, ()), (merged, ("--merge",))):
        done = cli("export", str(runs["ddp"]), "--out", str(out), *extra, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= {
        p.name for p in adapter.iterdir()
    }
    loading = python_block("docs/fine-tuning.md", "PeftModel.from_pretrained(base")
    monkeypatch.chdir(tmp_path)
    pasted: dict[str, Any] = {}
    exec(loading.replace("/shared/models/llama-3.2-1b-instruct", str(runs["base"])), pasted)
    tokens = torch.arange(32).unsqueeze(0) * 7 % 257
    plain_base = transformers.AutoModelForCausalLM.from_pretrained(runs["base"])
    with torch.no_grad():
        plain = plain_base(input_ids=tokens).logits
        peft = pasted["model"].eval()(input_ids=tokens).logits
        full = pasted["merged"].eval()(input_ids=tokens).logits
    assert torch.allclose(peft, full, atol=1e-5)
    assert not torch.allclose(plain, full, atol=1e-3)
    expected = (
        PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(runs["base"]), adapter
        )
        .merge_and_unload()
        .state_dict()
    )
    written = load_file(merged / "model.safetensors")
    assert written.keys() == expected.keys()
    assert all(torch.allclose(written[k], expected[k], atol=1e-6) for k in expected)
    original = load_file(runs["base"] / "model.safetensors")
    assert not torch.equal(written["lm_head.weight"], original["lm_head.weight"])
    card = (adapter / "README.md").read_text()
    assert "library_name: peft" in card and "LoRA adapters (rank 4) of the model `base`" in card
    assert "PeftModel.from_pretrained(base" in card and f"| steps | {STEPS} |" in card
    assert "library_name: transformers" in (merged / "README.md").read_text()


def test_an_adapter_run_exports_the_adapters_ema_with_weights_ema(runs, tmp_path):
    """--weights ema writes the average of each adapter (the base is frozen, so never averaged)
    in place of the trained adapter; peft loads it."""
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file

    out = tmp_path / "ema"
    done = cli("export", str(runs["ddp"]), "--out", str(out), "--weights", "ema", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    step = runs["ddp"] / "checkpoints" / f"step-{STEPS}"
    averages = torch.load(step / "ema.pt", weights_only=True)
    exported = load_file(out / "adapter_model.safetensors")
    assert exported
    adapters = {name: t for name, t in exported.items() if ".lora_" in name}
    assert len(adapters) == len(averages) == 10, sorted(averages)  # 2 x (q, v) x 2 layers, lm_head
    for name, tensor in adapters.items():
        trained_as = name.removeprefix("base_model.model.").replace(".weight", ".default.weight")
        assert torch.equal(tensor, averages[trained_as].float()), name
    trained = torch.load(step / "model.pt", weights_only=True)
    assert any(not torch.equal(trained[name], averages[name]) for name in averages)
    assert "| weights | the EMA of the trained weights" in (out / "README.md").read_text()
    base = transformers.AutoModelForCausalLM.from_pretrained(runs["base"])
    PeftModel.from_pretrained(base, out)


def test_a_merged_export_too_large_to_run_is_streamed_without_building_the_model(
    runs, tmp_path, monkeypatch
):
    """Past OUTPUTS_CHECKED_UP_TO neither the run's model nor the export is ever held whole: the
    files are checked by names and shapes, and hold the same tensors as the export that was run."""
    from safetensors.torch import load_file

    from qgtrain.ops.export import adapter, reload
    from qgtrain.ops.export.pipeline import export_run

    small = export_run(runs["ddp"], tmp_path / "small", merge=True, dtype="bf16")
    assert small.max_logit_diff is not None and small.dtype == "bf16"

    def never(*args):
        raise AssertionError("the whole model was built")

    monkeypatch.setattr(reload, "OUTPUTS_CHECKED_UP_TO", 0)
    monkeypatch.setattr(adapter, "_adapted_base", never)
    large = export_run(runs["ddp"], tmp_path / "large", merge=True, dtype="bf16")
    assert large.max_logit_diff is None
    want, got = (load_file(tmp_path / name / "model.safetensors") for name in ("small", "large"))
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert all(t.dtype == torch.bfloat16 for t in got.values())


def test_a_checkpoint_resumed_onto_another_base_is_refused(runs, tmp_path):
    other = save_llama(tmp_path / "other", 1)
    run = tmp_path / "run"
    shutil.copytree(runs["ddp"], run)
    done = cli("train", "--run-dir", str(run), "--set", *settings(other), cwd=tmp_path)
    assert done.returncode == 2
    said = done.stderr.strip().splitlines()[-1]
    assert str(runs["base"]) in said and str(other) in said


def test_unknown_targets_and_rank_0_are_refused(runs, tmp_path):
    done = cli(
        *train_command(
            tmp_path / "run", *settings(runs["base"], "model.lora_targets=[q_proj, qkv]")
        ),
        cwd=tmp_path,
    )
    said = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "model.lora_targets" in said and "qkv" in said
    assert all(
        name in said for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj")
    )
    done = cli(
        *train_command(tmp_path / "run", *settings(runs["base"], "model.lora_rank=0")),
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "model.lora_rank" in done.stderr.strip().splitlines()[-1]


def test_a_built_in_base_exports_merged_only_and_a_model_without_defaults_needs_targets(tmp_path):
    """The built-in GPT-2 (peft's default target c_attn) trains from train.seed; its adapters name
    no loadable base, so only --merge exports, and the merged model loads with transformers
    alone."""
    import transformers

    from qgtrain.foundation.errors import ConfigError, QgtrainError
    from qgtrain.ops.export.pipeline import export_run
    from qgtrain.training.adapters import apply_adapter
    from tests.helpers import tiny_config

    run = tmp_path / "run"
    sets = [
        "model.adapter=lora",
        "model.layers=2",
        "model.heads=2",
        "model.hidden=32",
        "data.name=synthetic",
        "data.seq_len=16",
        "train.batch_size=4",
        "train.max_steps=4",
        "logging.tensorboard=false",
    ]
    assert cli("train", "--run-dir", str(run), "--set", *sets, cwd=tmp_path).returncode == 0
    assert sorted({k.split(".lora_")[0].rpartition(".")[2] for k in final_keys(run)}) == ["c_attn"]
    with pytest.raises(QgtrainError, match="HINT: export the merged model with --merge"):
        export_run(run, tmp_path / "adapter")
    assert export_run(run, tmp_path / "merged", merge=True).kind == "merged"
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(merged).__name__ == "GPT2LMHeadModel" and not any(
        "lora" in n for n in merged.state_dict()
    )
    from tests.factories import tiny

    with pytest.raises(ConfigError, match=r"model\.lora_targets: .* name the modules to adapt"):
        apply_adapter(tiny(257, 16), tiny_config("model.adapter=lora"))


def final_keys(run: Path) -> list[str]:
    return list(final_keys_state(run))


def test_merge_on_finish_of_a_gpt2_base_unties_its_adapted_lm_head(tmp_path):
    """export.merge with export.on_finish: the run ends with the merged model, streamed from a GPT-2
    folder saved in shards: its Conv1D c_attn (fan_in_fan_out) as peft merges it, its adapted
    lm_head, tied to the input embedding, written as its own tensor (peft would add the delta to
    both), so transformers alone computes the PeftModel's logits."""
    import transformers
    from peft import get_peft_model
    from safetensors.torch import load_file

    from qgtrain.config.load import load_config
    from qgtrain.training.adapters import lora_config

    torch.manual_seed(0)
    config = byte_config("gpt2")
    base = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(config).save_pretrained(base, max_shard_size="60KB")
    assert (base / "model.safetensors.index.json").exists()
    run = tmp_path / "run"
    sets = settings(
        base,
        "model.lora_targets=[c_attn, lm_head]",
        "train.max_steps=4",
        "checkpoint.every_steps=0",
        "export.on_finish=true",
        "export.merge=true",
    )
    done = cli("train", "--run-dir", str(run), "--set", *sets, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    merged = transformers.AutoModelForCausalLM.from_pretrained(run / "export").eval()
    assert not merged.config.tie_word_embeddings and "lora" not in str(merged.state_dict().keys())

    cfg = load_config([ROOT / "config.yaml"], sets)
    peft = get_peft_model(
        transformers.AutoModelForCausalLM.from_pretrained(base),
        lora_config(cfg.model, ["c_attn", "lm_head"]),
    )
    adapters = {k.removeprefix("model."): t for k, t in final_keys_state(run).items()}
    assert not peft.base_model.model.load_state_dict(adapters, strict=False).unexpected_keys
    tokens = torch.arange(32).unsqueeze(0) * 5 % 257
    with torch.no_grad():
        assert torch.allclose(
            peft.eval()(input_ids=tokens).logits, merged(input_ids=tokens).logits, atol=1e-5
        )
    written = load_file(run / "export" / "model.safetensors")
    untouched = transformers.AutoModelForCausalLM.from_pretrained(base).state_dict()
    expected = peft.merge_and_unload().state_dict()  # lm_head's delta added to the tied wte
    for name in [k for k in expected if ".c_attn." in k]:
        assert torch.allclose(written[name], expected[name], atol=1e-6)
    assert torch.allclose(written["lm_head.weight"], expected["lm_head.weight"], atol=1e-6)
    assert torch.equal(written["transformer.wte.weight"], untouched["transformer.wte.weight"])


def test_an_adapter_export_on_finish_of_a_seeded_base_is_refused_at_config_load(tmp_path):
    from qgtrain.config.load import load_config
    from qgtrain.foundation.errors import ConfigError

    sets = ["model.adapter=lora", "export.on_finish=true"]
    with pytest.raises(ConfigError, match=r"export\.merge: .*train\.seed"):
        load_config([ROOT / "config.yaml"], sets)
    assert load_config([ROOT / "config.yaml"], [*sets, "export.merge=true"]).export.merge
    assert load_config(
        [ROOT / "config.yaml"], [*sets, "model.pretrained=somewhere"]
    ).export.on_finish
    done = cli("train", "--run-dir", str(tmp_path / "run"), "--set", *sets, cwd=tmp_path)
    said = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "export.merge" in said and not (tmp_path / "run").exists()


def final_keys_state(run: Path) -> dict[str, torch.Tensor]:
    last = max((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    return torch.load(last / "model.pt", weights_only=True)
