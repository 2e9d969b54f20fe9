"""The ready examples in jobs/ keep every promise the causal LM does. Runs against: real 2-rank
`qgtrain train` processes on jobs/graph.yaml (plain-torch message passing) and jobs/classifier.yaml
(a transformers sequence classifier), SIGKILLed at random steps and resumed, signalled on one rank,
and exported for transformers' own pipeline() and for qgtrain.load_model. jobs/molecules.yaml is
tested in test_molecules.py; jobs/mix.yaml streams the text its generator writes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import qgtrain
from qgtrain.config.load import load_config
from qgtrain.foundation.errors import EXIT_STOPPED
from qgtrain.tasks.mixture import streamed_splits
from tests.helpers import EXAMPLE_STEPS as MAX_STEPS
from tests.helpers import checkpoint_state, cli, example, records, train_command, wait_for
from tests.ranks import ROOT, kill_ranks, start_cli_ranks, wait_ranks


def final_state(run: Path) -> dict[str, torch.Tensor]:
    return checkpoint_state(run / "checkpoints" / f"step-{MAX_STEPS}")


def past(run: Path, step: int, saved: bool) -> bool:
    """The run has logged `step`, and where `saved`, has committed a checkpoint: the last kill
    comes after one, so the final launch resumes (a kill before any would rightly start over)."""
    logged = any(r["step"] >= step for r in records(run)[-1:])
    return logged and (not saved or any((run / "checkpoints").glob("step-*/manifest.json")))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["graph", "classifier"])
def test_sigkill_at_random_steps_then_resume_equals_the_uninterrupted_run(tmp_path, name):
    seed = int(os.environ.get("QGTRAIN_TEST_SEED", time.time()))
    first, last = sorted(random.Random(seed).sample(range(2, MAX_STEPS - 4), 2))
    reference, run = tmp_path / "reference", tmp_path / "killed"
    assert wait_ranks(
        start_cli_ranks(2, example(name, reference), tmp_path, log_prefix="ref"), 300
    ) == [0, 0]
    for step, saved in ((first, False), (last, True)):
        procs = start_cli_ranks(2, example(name, run), tmp_path, log_prefix="killed")
        wait_for(lambda: past(run, step, saved), procs, f"step {step}")
        kill_ranks(procs)
    assert wait_ranks(
        start_cli_ranks(2, example(name, run), tmp_path, log_prefix="killed"), 300
    ) == [0, 0]

    context = f"(seed {seed}: kills at steps {first} and {last})"
    expected, got = records(reference), records(run)
    assert [r["step"] for r in got] == list(range(1, MAX_STEPS + 1)), context
    for want, have in zip(expected, got):
        compared = [k for k in want if k == "loss" or k.startswith(("val_", "test_"))]
        assert {k: have.get(k) for k in compared} == {k: want[k] for k in compared}, (
            f"step {want['step']} {context}"
        )
    assert "val_accuracy" in expected[-1] and "test_accuracy" in expected[-1]
    want, have = final_state(reference), final_state(run)
    assert want.keys() == have.keys()
    assert all(torch.equal(want[k], have[k]) for k in want), context
    assert "resumed from" in (run / "logs" / "rank_0.log").read_text(), context


@pytest.mark.slow
@pytest.mark.parametrize("name", ["graph", "classifier"])
def test_a_signal_to_one_rank_stops_both_at_one_checkpoint(tmp_path, name):
    run = tmp_path / "run"
    procs = start_cli_ranks(
        2,
        example(
            name, run, "train.max_steps=100000", "checkpoint.every_steps=0", "train.eval_every=0"
        ),
        tmp_path,
    )
    wait_for(lambda: len(records(run)) >= 3, procs, "three steps")
    os.kill(procs[1].pid, signal.SIGUSR2)
    assert wait_ranks(procs, 60) == [EXIT_STOPPED, EXIT_STOPPED]
    saved = [p for p in (run / "checkpoints").iterdir()]
    assert len(saved) == 1
    step = json.loads((saved[0] / "manifest.json").read_text())["step"]
    assert (
        f"stopping at step {step} on a signal that reached another rank"
        in (run / "logs" / "rank_0.log").read_text()
    )
    assert f"stopping at step {step} on SIGUSR2" in (run / "logs" / "rank_1.log").read_text()


@pytest.mark.slow
def test_the_classifier_exports_for_transformers_pipeline_and_the_graph_model_for_load_model(
    tmp_path,
):
    runs = {name: tmp_path / name for name in ("graph", "classifier")}
    for name, run in runs.items():
        assert wait_ranks(
            start_cli_ranks(2, example(name, run, "train.max_steps=8"), tmp_path), 300
        ) == [0, 0]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "classifier-export"
    done = cli("export", str(runs["classifier"]), "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "reloaded and compared with the checkpoint" in done.stdout
    code = (
        "import json, sys\nfrom transformers import pipeline\nclassify = "
        f"pipeline('text-classification', model={str(out)!r})\nprint(json.dumps(classify(['import "
        "json\\nprint(json.dumps({}))', 'async def main():\\n    await x'])))"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        # plain transformers
        env={k: v for k, v in env.items() if k != "PYTHONPATH"},
        cwd=tmp_path,
    )
    assert shown.returncode == 0, shown.stderr[-2000:]
    labels = {item["label"] for item in json.loads(shown.stdout.strip().splitlines()[-1])}
    assert labels <= {"json", "asyncio", "unittest", "email"} and labels
    graph = cli("export", str(runs["graph"]), "--out", str(tmp_path / "graph-export"), cwd=tmp_path)
    assert graph.returncode == 0, graph.stderr[-2000:]
    model = qgtrain.load_model(tmp_path / "graph-export", trust_code=True)  # by the task function
    saved = torch.load(runs["graph"] / "checkpoints" / "step-8" / "model.pt", weights_only=True)
    assert type(model).__name__ == "GraphClassifier" and len(saved) > 4
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())


@pytest.mark.slow
def test_an_export_on_finish_that_fails_ends_every_rank_with_its_outcome(tmp_path):
    """A model whose outputs are random in eval mode cannot be checked after reloading: training
    finishes, rank 0's export fails, and both ranks say so with exit 1 instead of one waiting in a
    barrier for the other."""
    run = tmp_path / "run"
    procs = start_cli_ranks(
        2,
        train_command(
            run,
            "task=tests.tasks:noisy_in_eval",
            "train.batch_size=8",
            "train.max_steps=8",
            "logging.tensorboard=false",
            "export.on_finish=true",
        ),
        tmp_path,
    )
    assert wait_ranks(procs, 300) == [1, 1]
    for rank in (0, 1):
        log = (run / "logs" / f"rank_{rank}.log").read_text()
        assert (
            "training finished, but the export failed (exit 2): qgtrain: error: export: the "
            "reloaded model's "
            "outputs differ from the checkpoint's" in log
        )
    assert json.loads((run / "status.json").read_text())["status"] == "finished"
    assert (run / "checkpoints" / "step-8").is_dir() and not (run / "export").exists()


def test_the_streamed_mix_job_reads_what_its_generator_writes_on_up_to_8_reading_slots(
    tmp_path, monkeypatch
):
    """jobs/mix.yaml run from where jobs/examples/mix_data.py wrote its files (the repository root
    for a user): both sources found, each with a file per slot of 4 ranks x 2 loader workers."""
    subprocess.run(
        [sys.executable, str(ROOT / "jobs" / "examples" / "mix_data.py"), "--mb", "0.2"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        timeout=120,
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config([ROOT / "config.yaml", ROOT / "jobs" / "mix.yaml"])
    assert cfg.data.stream and cfg.data.num_workers == 2
    mixture, val, test, vocab = streamed_splits(replace(cfg.data, num_workers=8), cfg.train.seed)
    assert [(s.name, s.weight) for s in mixture.sources] == [("docs", 2.0), ("code", 1.0)]
    assert len(val) > 0 and len(test) > 0 and vocab == 257
    assert next(iter(mixture)).shape == (cfg.data.seq_len,)
