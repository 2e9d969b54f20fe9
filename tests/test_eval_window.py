"""Multiple-choice items longer than the model's window, as the shipped jobs/eval.yaml meets them on
a short data.seq_len: a long context is cut from the left (lm-eval's rule) and scored, a choice
longer than the window alone is refused before step 1 in one line naming its file:line. Runs
against: the scoring on a tiny GPT-2 with the byte tokenizer, and real `qgtrain train` processes on
the example job's own items (jobs/examples/eval_data.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from qgtrain.data.tokenizer import byte_level
from qgtrain.evals import scoring
from tests.helpers import ROOT, cli, example_eval_items, one_error_line, records, tiny_gpt2

WINDOW = 16


def test_a_context_too_long_for_the_window_is_cut_from_the_left_and_the_choice_kept_whole():
    model = scoring.Model(
        tiny_gpt2().eval(), byte_level(), 256, WINDOW, torch.device("cpu"), "fp32", 4, False
    )
    context = "total = 0\nfor n in numbers:\n    total +="
    pairs = [scoring.continuation_pair(model, context, end) for end in (" n", " n * n\n" * 2)]
    assert all(len(ctx) + len(cont) > WINDOW + 1 for ctx, cont in pairs), "long enough to cut"
    cut = [(ctx[-(WINDOW + 1 - len(cont)) :], cont) for ctx, cont in pairs]
    assert scoring.log_likelihoods(model, pairs) == scoring.log_likelihoods(model, cut)
    whole = scoring.continuation_pair(model, context, "x" * WINDOW)
    assert len(whole[1]) == WINDOW and len(scoring.log_likelihoods(model, [whole])) == 1


def eval_job(run: Path, *sets: str) -> list[str]:
    """jobs/eval.yaml on a window of 32 tokens: validations at steps 2 and 4."""
    return [
        "train",
        "--config",
        str(ROOT / "config.yaml"),
        "--config",
        str(ROOT / "jobs" / "eval.yaml"),
        "--run-dir",
        str(run),
        "--set",
        "data.seq_len=32",
        "data.corpus_mb=0.2",
        "model.hidden=32",
        "model.layers=1",
        "model.heads=2",
        "train.batch_size=4",
        "train.max_steps=4",
        "train.eval_every=2",
        "checkpoint.every_steps=2",
        "optim.warmup_steps=1",
        "logging.tensorboard=false",
        *sets,
    ]


@pytest.mark.slow
def test_eval_yaml_on_a_short_window_refuses_choices_too_long_and_scores_long_contexts(tmp_path):
    items = example_eval_items(tmp_path)
    rows = [json.loads(line) for line in items.read_text().splitlines()]
    first = next(
        number
        for number, row in enumerate(rows, start=1)
        if any(len(("\n" + c).encode()) > 32 for c in row["choices"])
    )
    refused = tmp_path / "refused"
    said = one_error_line(cli(*eval_job(refused), cwd=tmp_path))
    assert said.startswith(f"qgtrain: error: eval.tasks: {items}:{first}: a choice of "), said
    assert "longer than the 32 tokens the model sees (data.seq_len)" in said, said
    assert not records(refused) and not (refused / "checkpoints").exists(), "before step 1"

    # the same items with choices that fit the window, their contexts still longer than it
    short = [{**row, "choices": [c.strip()[:24] for c in row["choices"]]} for row in rows]
    assert any(len(row["context"].encode()) > 32 for row in short)
    items.write_text("".join(json.dumps(row) + "\n" for row in short))
    run = tmp_path / "run"
    done = cli(*eval_job(run), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    scored = [r for r in records(run) if "eval_next_line_acc" in r]
    assert [r["step"] for r in scored] == [2, 4], records(run)
    assert all(0 <= r["eval_next_line_acc"] <= 1 for r in scored)
