"""The EMA of the weights across a SIGKILL, under ddp and fsdp, and exported: two training ranks
(real processes in a real gloo group, tests/ranks.py) SIGKILLed at a random step and resumed,
compared with the uninterrupted run bit for bit (the loss, the validations on the average, the
weights, the optimizer and the average); the resumed run's average exported with `--weights ema` and
loaded by transformers itself."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import SMALL_GPT2, checkpoint_state, records, wait_for
from tests.ranks import ROOT, run_ranks, start_ranks, train_rank

KILLED_STEPS = 12
# The sharded runs' small GPT-2, validating every 2 steps and saving every 3 (later --set wins).
GPT2 = [
    *SMALL_GPT2,
    "train.eval_every=2",
    "checkpoint.every_steps=3",
    f"train.max_steps={KILLED_STEPS}",
    "train.ema_decay=0.9",
    "train.eval_ema=true",
    "model.dropout=0.1",
]


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path, str]]:
    from qgtrain.config.load import load_config

    made = {}
    for layout in ("ddp", "fsdp"):
        tmp = tmp_path_factory.mktemp(f"killed-{layout}")
        sets = [*GPT2, f"train.parallel={layout}"]
        cfg = load_config([ROOT / "config.yaml"], sets)
        # The reference validates on its training weights: the killed run's validations on the
        # average must leave its training exactly as the reference's.
        raw = load_config([ROOT / "config.yaml"], [*sets, "train.eval_ema=false"])
        assert [r["exit"] for r in run_ranks(2, train_rank, raw, str(tmp / "reference"))] == [0, 0]
        seed = int(os.environ.get("QGTRAIN_TEST_SEED", time.time()))
        kill_at = random.Random(seed).randrange(4, 10)
        run = tmp / "killed"
        procs = start_ranks(2, train_rank, cfg, str(run))
        try:
            wait_for(
                lambda: any(r["step"] >= kill_at for r in records(run)[-1:]),
                procs,
                f"step {kill_at}",
                300,
            )
        finally:
            for proc in procs:
                proc.kill()  # SIGKILL
                proc.join()
        assert [r["exit"] for r in run_ranks(2, train_rank, cfg, str(run))] == [0, 0]
        made[layout] = (tmp / "reference", run, f"(seed {seed}: {layout} killed at step {kill_at})")
    return made


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_sigkill_then_resume_with_ema_equals_the_uninterrupted_run(killed, layout):
    """Killed and resumed, validating on the average: the uninterrupted run's losses, weights,
    optimizer state and average, bit for bit; its validations (on its training weights) differ."""
    reference, run, context = killed[layout]
    expected, got = records(reference), records(run)
    assert [r["step"] for r in got] == list(range(1, KILLED_STEPS + 1)), context
    assert [r["loss"] for r in got] == [r["loss"] for r in expected], context
    validated = [(a["val_loss"], b["val_loss"]) for a, b in zip(expected, got) if "val_loss" in a]
    assert len(validated) == KILLED_STEPS // 2 and all(a != b for a, b in validated), context
    last = f"checkpoints/step-{KILLED_STEPS}"
    assert (
        (run / last / "sharded").is_dir()
        == (layout == "fsdp")
        == (not (run / last / "ema.pt").exists())
    )
    want, have = checkpoint_state(reference / last), checkpoint_state(run / last)
    averages = [k for k in want if k.startswith("ema.")]
    assert (
        want.keys() == have.keys()
        and len(averages) == len([k for k in want if k.startswith("model.")]) - 1
    )
    assert all(torch.equal(tensor, have[name]) for name, tensor in want.items()), context
    assert not torch.equal(want["ema.transformer.wte.weight"], want["model.transformer.wte.weight"])
    assert "resumed from" in (run / "logs" / "rank_0.log").read_text(), context


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ddp", "fsdp"])
def test_export_weights_ema_loads_with_transformers_and_holds_the_average(killed, layout, tmp_path):
    from transformers import AutoModelForCausalLM

    from qgtrain.ops.export.pipeline import export_run

    _, run, _ = killed[layout]
    done = export_run(run, tmp_path / "hf", weights="ema")
    assert done.max_logit_diff is not None and done.max_logit_diff <= 1e-6
    saved = checkpoint_state(run / "checkpoints" / f"step-{KILLED_STEPS}")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    names = dict(model.named_parameters(remove_duplicate=False))
    assert "lm_head.weight" in names and names["lm_head.weight"] is names["transformer.wte.weight"]
    assert model.config.vocab_size == 257  # the padded vocabulary exported with its real rows
    for name, param in model.named_parameters():
        average = saved[f"ema.{name}"]
        assert torch.equal(param, average[:257] if average.shape[0] == 320 else average), name
    meta = json.loads((tmp_path / "hf" / "qgtrain_model.json").read_text())
    assert meta["run"]["weights"] == "ema"
