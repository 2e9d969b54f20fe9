"""Hugging Face export. Runs against: real training runs (tests/ranks.py), real transformers
reloading the exported folders, and `pipeline` in a separate Python process that never imports
qgtrain."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from qgtrain.config.load import load_config
from qgtrain.foundation.errors import CheckpointError, QgtrainError
from qgtrain.ops.export import writer
from qgtrain.ops.export.pipeline import export_run
from qgtrain.state import checkpoint
from tests.doc_blocks import python_block
from tests.helpers import records
from tests.ranks import run_ranks, train_rank


def small_lm(tmp_path: Path, *sets: str):  # type: ignore[no-untyped-def]
    return load_config(
        [],
        [
            "model.layers=1",
            "model.hidden=32",
            "model.heads=2",
            "data.seq_len=32",
            "data.corpus_mb=0.2",
            f"data.cache_dir={tmp_path / 'data'}",
            "train.batch_size=8",
            "train.max_steps=30",
            "train.eval_every=10",
            "train.eval_batches=2",
            "checkpoint.every_steps=10",
            "logging.tensorboard=false",
            "optim.warmup_steps=5",
            *sets,
        ],
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("trained")
    assert run_ranks(1, train_rank, small_lm(tmp), str(tmp / "run"))[0]["exit"] == 0
    return tmp / "run"


def checkpoint_logits(ckpt_dir: Path, tokens: torch.Tensor) -> torch.Tensor:
    """The checkpoint model's logits on the real vocabulary (its embedding is padded: lm_shape)."""
    import transformers

    hf = json.loads((ckpt_dir / "hf_config.json").read_text())
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    )
    model.load_state_dict(torch.load(ckpt_dir / "model.pt", weights_only=True))
    vocab = json.loads((ckpt_dir / "model.json").read_text())["vocab_size"]
    return model.eval()(input_ids=tokens).logits[..., :vocab]


def test_the_export_reloads_with_transformers_and_matches_the_checkpoint(trained, tmp_path):
    import transformers

    done = export_run(trained, tmp_path / "out")
    assert done.checkpoint == trained / "checkpoints" / "step-30" and done.max_logit_diff <= 1e-6
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "README.md",
    } <= names
    tokens = torch.tensor([list(b"def main():\n    return 0")])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert reloaded.config.vocab_size == 257  # the tokenizer's: exported unpadded
    with torch.no_grad():
        diff = (
            (reloaded(input_ids=tokens).logits - checkpoint_logits(done.checkpoint, tokens))
            .abs()
            .max()
        )
    assert diff <= 1e-6
    import qgtrain

    assert type(qgtrain.load_model(tmp_path / "out")).__name__ == "GPT2LMHeadModel"
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok.encode("héllo, wörld") == list("héllo, wörld".encode()) and tok.eos_token_id == 256
    card = (tmp_path / "out" / "README.md").read_text()
    for fact in (
        "| steps | 30 |",
        "| tokens seen | 7,680 |",
        "final validation loss",
        "run_name: tiny-gpt2",
    ):
        assert fact in card


def test_pipeline_generates_in_a_process_that_never_imports_qgtrain(trained, tmp_path):
    """The export page's lines, as written, in a folder holding the export as models/tiny-gpt2."""
    export_run(trained, tmp_path / "models" / "tiny-gpt2")
    code = python_block("docs/export.md", 'pipeline("text-generation"') + (
        "import sys\nassert 'qgtrain' not in sys.modules\nprint('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout  # the generated text, which may span lines, then ok
    assert out.startswith("def main(") and out.endswith("\nok\n"), out
    assert len(out) > len("def main(\nok\n"), "something was generated"


def test_best_and_step_pick_checkpoints_and_large_models_are_sharded(
    trained, tmp_path, monkeypatch
):
    best = export_run(trained, tmp_path / "best", best=True)
    scored = [
        c for c in checkpoint.list_committed(trained / "checkpoints") if c.val_loss is not None
    ]
    assert best.checkpoint == min(scored, key=lambda c: c.val_loss).path
    monkeypatch.setattr(writer, "SHARD_SIZE", "20KB")
    done = export_run(trained, tmp_path / "step20", step=20)
    assert (
        done.checkpoint.name == "step-20"
        and (tmp_path / "step20" / "model.safetensors.index.json").exists()
    )
    with pytest.raises(QgtrainError, match="no checkpoint at step 7 in .*; there are: 10, 20, 30"):
        export_run(trained, tmp_path / "x", step=7)


def test_an_export_replaces_only_an_earlier_export_and_only_with_force(trained, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    for force in (False, True):
        with pytest.raises(QgtrainError, match=r"not a qgtrain export \('keep.txt'\)"):
            export_run(trained, out, force=force)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "mine"
    earlier = tmp_path / "earlier"
    export_run(trained, earlier)
    with pytest.raises(QgtrainError, match="holds an earlier export; choose another --out or"):
        export_run(trained, earlier)
    (earlier / "stale.txt").write_text("from the earlier export")
    export_run(trained, earlier, force=True)
    assert not (earlier / "stale.txt").exists() and (earlier / "config.json").exists()


@pytest.mark.parametrize(
    "source, message",
    [
        ("nowhere", "does not exist; give a run directory or a checkpoint folder"),
        ("empty", "holds no committed checkpoint"),
    ],
)
def test_wrong_sources_fail_clearly(tmp_path, source, message):
    (tmp_path / "empty").mkdir()
    with pytest.raises(QgtrainError, match=message):
        export_run(tmp_path / source, tmp_path / "out")


def test_a_checkpoint_without_a_model_is_refused(tmp_path):
    staging = checkpoint.staging_dir(tmp_path / "checkpoints", 5, "r")
    staging.mkdir(parents=True)
    files = checkpoint.write_files(staging, {"state.json": b"{}"})
    ckpt = checkpoint.commit(
        staging, tmp_path / "checkpoints" / "step-5", files, {"step": 5, "run_id": "r"}
    )
    with pytest.raises(CheckpointError, match="has no model weights or config to export"):
        export_run(ckpt.path, tmp_path / "out")


def test_cli_export_errors_are_one_line_with_exit_code_2(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "qgtrain",
            "export",
            str(tmp_path / "nope"),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
    )
    assert (
        result.returncode == 2
        and result.stderr.count("\n") == 1
        and "does not exist" in result.stderr
    )


def test_cli_export_into_other_files_is_one_line_with_exit_2_even_with_force(trained, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = subprocess.run(
        [sys.executable, "-m", "qgtrain", "export", str(trained), "--out", str(out), "--force"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert f"export: {out} holds files that are not a qgtrain export ('keep.txt')" in result.stderr
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["keep.txt"]


def test_a_bf16_run_and_a_two_rank_run_export_cleanly(tmp_path):
    assert (
        run_ranks(
            1, train_rank, small_lm(tmp_path, "train.precision=bf16"), str(tmp_path / "bf16")
        )[0]["exit"]
        == 0
    )
    assert (
        json.loads((tmp_path / "bf16" / "checkpoints" / "step-30" / "state.json").read_text())[
            "precision"
        ]
        == "bf16"
    )
    assert export_run(tmp_path / "bf16", tmp_path / "bf16-out").max_logit_diff <= 1e-6
    results = run_ranks(2, train_rank, small_lm(tmp_path), str(tmp_path / "ddp"))
    assert [r["exit"] for r in results] == [0, 0]
    export_run(tmp_path / "ddp", tmp_path / "ddp-out")
    with safe_open(tmp_path / "ddp-out" / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    assert keys and not any(k.startswith(("module.", "_orig_mod.")) for k in keys)


def test_train_export_finetune_export_round_trip(trained, tmp_path):
    first = export_run(trained, tmp_path / "models" / "tiny-gpt2")
    cfg = small_lm(
        tmp_path,
        f"model.pretrained={first.folder}",
        "train.run_name=finetune",
        "optim.lr=3e-4",
        "optim.min_lr=3e-5",
        "train.max_steps=10",
        "export.on_finish=true",
    )
    assert run_ranks(1, train_rank, cfg, str(tmp_path / "finetune"))[0]["exit"] == 0
    log = (tmp_path / "finetune" / "logs" / "rank_0.log").read_text()
    assert f"using the tokenizer of model.pretrained ({first.folder})" in log
    first_loss = records(tmp_path / "finetune")[0]["loss"]
    pretrained_loss = records(trained)[-1]["loss"]
    assert first_loss < pretrained_loss + 0.5, (
        "fine-tuning starts from the exported weights, not from scratch"
    )
    on_finish = tmp_path / "finetune" / "export"
    assert (on_finish / "config.json").exists() and (on_finish / "tokenizer.json").exists()
    again = export_run(tmp_path / "finetune", tmp_path / "again")
    assert again.max_logit_diff <= 1e-6


def test_any_model_exports_its_state_dict_and_load_model_gives_it_back(tmp_path):
    import qgtrain
    from tests.factories import TinyHubLM, TinyLM

    cfg = small_lm(
        tmp_path, "model.factory=tests.factories:tiny", "train.max_steps=2", "train.eval_every=0"
    )
    assert run_ranks(1, train_rank, cfg, str(tmp_path / "plain"))[0]["exit"] == 0
    done = export_run(tmp_path / "plain", tmp_path / "plain-out")
    assert done.kind == "state_dict" and done.max_logit_diff == 0
    assert {p.name for p in (tmp_path / "plain-out").iterdir()} == {
        "model.safetensors",
        "qgtrain_model.json",
        "README.md",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    trained = torch.load(done.checkpoint / "model.pt", weights_only=True)
    # the model's own names
    with safe_open(tmp_path / "plain-out" / "model.safetensors", "pt") as f:
        assert sorted(f.keys()) == sorted(trained) and all(
            torch.equal(f.get_tensor(k), trained[k]) for k in trained
        )
    model = qgtrain.load_model(tmp_path / "plain-out", trust_code=True)
    assert type(model) is TinyLM and not model.training
    assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items())
    card = (tmp_path / "plain-out" / "README.md").read_text()
    assert "qgtrain.load_model" in card and "| steps | 2 |" in card and "TinyLM(...)" in card

    cfg = small_lm(
        tmp_path,
        "model.factory=tests.factories:tiny_hub",
        "train.max_steps=2",
        "train.eval_every=0",
    )
    assert run_ranks(1, train_rank, cfg, str(tmp_path / "hub"))[0]["exit"] == 0
    done = export_run(tmp_path / "hub", tmp_path / "hub-out")
    assert (
        done.kind == "hub"
        and done.max_logit_diff == 0
        and (tmp_path / "hub-out" / "model.safetensors").exists()
    )
    assert type(qgtrain.load_model(tmp_path / "hub-out", trust_code=True)) is TinyHubLM


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_task_model_trained_on_two_ranks_comes_back_giving_the_runs_test_metric(
    tmp_path, parallel
):
    import qgtrain
    from tests.tasks import classify_loss, points

    cfg = load_config(
        [],
        [
            "task=tests.tasks:points",
            "train.batch_size=8",
            "train.max_steps=12",
            "train.eval_every=6",
            "checkpoint.every_steps=6",
            "logging.tensorboard=false",
            f"train.parallel={parallel}",
            "train.shard_modules=[Linear]",
            "optim.warmup_steps=2",
        ],
    )
    assert [r["exit"] for r in run_ranks(2, train_rank, cfg, str(tmp_path / "run"))] == [0, 0]
    if parallel == "fsdp":
        assert (tmp_path / "run" / "checkpoints" / "step-12" / "sharded").is_dir()
    export_run(tmp_path / "run", tmp_path / "out")
    model = qgtrain.load_model(tmp_path / "out", trust_code=True)
    reported = json.loads((tmp_path / "out" / "qgtrain_model.json").read_text())["run"]["test"]
    last = records(tmp_path / "run")[-1]
    assert reported == {"loss": last["test_loss"], "accuracy": last["test_accuracy"]}
    split = points(cfg).test
    batch = torch.utils.data.default_collate([split[i] for i in range(len(split))])
    with torch.no_grad():
        correct = int((model(batch["x"]).argmax(1) == batch["label"]).sum())
        loss = float(classify_loss(model, batch))
    # one process, the whole split at once: the same model
    assert correct / len(split) == reported["accuracy"]
    assert loss == pytest.approx(reported["loss"], rel=1e-6)
