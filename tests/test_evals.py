"""Downstream evaluation as users run it: eval.tasks scored in the loop, `qgtrain eval` on a run's
checkpoints and on an export, lm-evaluation-harness on the same items. Runs against: real `qgtrain`
processes (1 and 2 ranks, ddp and fsdp, SIGKILLed mid-way), a GPT-2 built by transformers and
trained here on sentences whose questions it then answers, the real lm-eval package offline."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qgtrain.config.load import load_config
from qgtrain.evals.items import read_tasks
from qgtrain.foundation.errors import ConfigError
from tests.helpers import (
    ROOT,
    cli,
    example_eval_items,
    one_error_line,
    records,
    train_command,
    wait_for,
)
from tests.ranks import kill_ranks, start_cli_ranks, wait_ranks

NAMES = "anna bert carl dora emil fred gina hugo".split()
COLORS = [" red", " blue", " green", " gold"]
FAVOURITE = {name: COLORS[i % 4] for i, name in enumerate(NAMES)}
STEPS, EVERY = 200, 40
CHECKPOINTS = list(range(EVERY, STEPS + 1, EVERY))
METRICS = ("eval_facts_acc", "eval_facts_acc_norm", "eval_say_exact_match", "eval_text_loss")


def write_tasks(folder: Path) -> None:
    """Training text that states each name's colour, and three tasks that ask for it."""
    rng = random.Random(0)
    docs = [" ".join(f"{n} likes{FAVOURITE[n]}." for n in rng.sample(NAMES, 4)) for _ in range(600)]
    lines = {
        "train": [{"text": doc} for doc in docs],
        "mc": [
            {"context": f"{n} likes", "choices": COLORS, "label": COLORS.index(FAVOURITE[n])}
            for n in NAMES
        ],
        "gen": [{"prompt": f"{n} likes", "answer": FAVOURITE[n]} for n in NAMES],
        "ppl": [{"text": f"{n} likes{FAVOURITE[n]}."} for n in NAMES],
    }
    for name, rows in lines.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def eval_sets(folder: Path) -> list[str]:
    return [
        f"eval.tasks=[{{name: facts, kind: multiple_choice, files: ['{folder}/mc.jsonl']}}, "
        f"{{name: say, kind: generate, files: ['{folder}/gen.jsonl']}}, "
        f"{{name: text, kind: perplexity, files: ['{folder}/ppl.jsonl']}}]",
        "eval.stop=['.']",
        "eval.max_new_tokens=8",
        "eval.samples=5",
    ]


def train_args(folder: Path, run: Path, *more: str) -> list[str]:
    return train_command(
        run,
        "data.name=files",
        # relative: the held-out split hashes the path as given, so every temp folder splits alike
        "data.files=['train.jsonl']",
        "data.seq_len=32",
        f"data.cache_dir={folder / 'cache'}",
        "model.hidden=64",
        "model.layers=2",
        "model.heads=2",
        f"train.max_steps={STEPS}",
        "train.batch_size=16",
        f"train.eval_every={EVERY}",
        "train.eval_batches=2",
        f"train.log_every={EVERY}",
        "optim.lr=0.006",
        "optim.warmup_steps=10",
        f"checkpoint.every_steps={EVERY}",
        "checkpoint.keep_last=5",
        "logging.tensorboard=false",
        "early_stopping.metric=eval_facts_acc",
        "early_stopping.mode=max",
        *eval_sets(folder),
        *more,
    )


def evaluated(run: Path) -> dict[int, dict[str, float]]:
    """The in-loop figures of each validation step."""
    return {r["step"]: r for r in records(run) if "eval_facts_acc" in r}


def results(folder: Path) -> list[dict]:
    path = folder / "eval" / "results.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def by_step(lines: list[dict]) -> dict[int | None, dict[str, float]]:
    merged: dict[int | None, dict[str, float]] = {}
    for line in lines:
        merged.setdefault(line["step"], {}).update(
            {k: v for k, v in line.items() if k.startswith("eval_")}
        )
    return merged


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the task files' folder, a run trained on them with the tasks in the loop)."""
    folder = tmp_path_factory.mktemp("evals")
    write_tasks(folder)
    run = folder / "run"
    done = cli(*train_args(folder, run), cwd=folder)
    assert done.returncode == 0, done.stderr
    return folder, run


@pytest.mark.slow
def test_a_trained_model_answers_its_questions_and_qgtrain_eval_agrees_with_the_loop(trained):
    folder, run = trained
    loop = evaluated(run)
    assert sorted(loop) == CHECKPOINTS
    final = loop[STEPS]
    # chance is 1 in 4
    assert final["eval_facts_acc"] >= 0.6 and final["eval_facts_acc_norm"] >= 0.75, final
    assert final["eval_say_exact_match"] >= 0.5 and final["eval_text_ppl"] < 3, final
    assert loop[EVERY]["eval_text_loss"] > final["eval_text_loss"], "it learned the sentences"
    samples = [
        json.loads(x) for x in (run / "eval" / f"step-{STEPS}.jsonl").read_text().splitlines()
    ]
    assert [s["index"] for s in samples] == list(range(5))
    assert [s["prompt"] for s in samples] == [f"{n} likes" for n in NAMES[:5]]
    assert all("." not in s["output"] for s in samples), "the stop string is cut"

    done = cli("eval", str(run), "--all", cwd=folder)
    assert done.returncode == 0, done.stderr
    scored = by_step(results(run))
    assert sorted(scored) == CHECKPOINTS
    for step, figures in scored.items():
        for name in METRICS:
            assert figures[name] == pytest.approx(loop[step][name], abs=1e-9), (step, name)
    assert "eval_facts_acc" in done.stdout and str(STEPS) in done.stdout, "a table on the console"

    best = max(loop, key=lambda s: (loop[s]["eval_facts_acc"], s))
    out = folder / "best"
    exported = cli("export", str(run), "--best", "--out", str(out), cwd=folder)
    assert exported.returncode == 0, exported.stderr
    assert f"step-{best} " in exported.stdout, (best, exported.stdout)
    lowest = min(loop, key=lambda s: (loop[s]["eval_text_loss"], -s))
    by_loss = cli(
        "export", str(run), "--best", "eval_text_loss", "--out", str(folder / "low"), cwd=folder
    )
    assert by_loss.returncode == 0 and f"step-{lowest} " in by_loss.stdout, by_loss.stderr


@pytest.mark.slow
def test_eval_all_killed_midway_goes_on_and_scores_each_checkpoint_once(trained):
    folder, run = trained
    copy = folder / "killed-eval"
    subprocess.run(["cp", "-a", str(run), str(copy)], check=True)
    (copy / "eval" / "results.jsonl").unlink(missing_ok=True)
    slow = ["--set", "eval.max_new_tokens=24", "eval.stop=[]"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "qgtrain", "eval", str(copy), "--all", *slow],
        cwd=folder,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    first = copy / "eval" / "results.jsonl"
    wait_for(lambda: first.is_file() and first.read_text().count("\n") >= 1, [proc], "a result")
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    before = len(results(copy))
    assert 1 <= before < 3 * len(CHECKPOINTS), "killed between its first and last task"
    done = cli("eval", str(copy), "--all", *slow, cwd=folder)
    assert done.returncode == 0, done.stderr
    pairs = [(line["step"], line["task"]) for line in results(copy)]
    assert sorted(pairs) == sorted((s, t) for s in CHECKPOINTS for t in ("facts", "say", "text"))
    assert "already scored" in done.stderr or before < 3


@pytest.mark.slow
def test_an_export_scores_as_the_loop_did_and_lm_eval_agrees_on_the_same_items(trained):
    folder, run = trained
    export = folder / "export"
    assert cli("export", str(run), "--step", "80", "--out", str(export), cwd=folder).returncode == 0
    one = cli("eval", str(export), "--set", *eval_sets(folder), cwd=folder)
    assert one.returncode == 0, one.stderr
    alone = by_step(results(export))[None]
    loop = evaluated(run)[80]
    for name in METRICS:
        assert alone[name] == pytest.approx(loop[name], abs=1e-6), name
    samples = (export / "eval" / "step-0.jsonl").read_text()
    assert samples == (run / "eval" / "step-80.jsonl").read_text(), "the loop's outputs"

    tasks = folder / "harness"
    tasks.mkdir()
    (tasks / "facts_h.yaml").write_text(
        "task: facts_h\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder}/mc.jsonl\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "doc_to_text: context\n"
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        "target_delimiter: ''\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    harness = cli(  # task YAMLs are code (tests/test_trust_remote.py): these are the test's own
        "eval",
        str(export),
        "--harness",
        "facts_h",
        "--include-path",
        str(tasks),
        "--trust-code",
        cwd=folder,
    )
    assert harness.returncode == 0, harness.stderr
    theirs = [line for line in results(export) if line.get("harness") == "lm-eval"][0]
    assert theirs["eval_facts_h_acc"] == pytest.approx(alone["eval_facts_acc"], abs=1e-9)
    assert theirs["eval_facts_h_acc_norm"] == pytest.approx(alone["eval_facts_acc_norm"], abs=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_ranks_score_in_the_loop_as_one_process_scores_their_checkpoint(trained, parallel):
    folder, _ = trained
    run = folder / f"two-{parallel}"
    args = train_args(folder, run, f"train.parallel={parallel}", "train.max_steps=40")
    assert wait_ranks(start_cli_ranks(2, args, folder, log_prefix=parallel), 300) == [0, 0]
    loop = evaluated(run)[40]
    done = cli("eval", str(run), cwd=folder)
    assert done.returncode == 0, done.stderr
    scored = [by_step(results(run))[40]]
    if parallel == "fsdp":  # again on 2 ranks, each holding its shards of the model
        (run / "eval" / "results.jsonl").unlink()
        ranks = start_cli_ranks(2, ["eval", str(run)], folder, log_prefix="eval-fsdp")
        assert wait_ranks(ranks, 300) == [0, 0], (folder / "eval-fsdp-1.out").read_text()[-2000:]
        log = (folder / "eval-fsdp-0.out").read_text()
        assert "fsdp: sharding 2 GPT2Block blocks and the root over 2 ranks" in log
        scored.append(by_step(results(run))[40])
    for alone in scored:
        assert alone["eval_facts_acc"] == loop["eval_facts_acc"]
        assert alone["eval_say_exact_match"] == loop["eval_say_exact_match"]
        assert alone["eval_text_loss"] == pytest.approx(loop["eval_text_loss"], rel=1e-5)


@pytest.mark.slow
def test_a_transformers_model_generates_with_its_cache_as_it_does_without(trained):
    """scoring.generate's two ways on the trained model: each new token forwarded once against the
    cache of those before it (a transformers model's way), and the whole window forwarded for each
    token (any other model's): the same outputs, for prompts of three lengths in one batch (padded
    on the left for the cache)."""
    import torch

    from qgtrain.data import tokenizer
    from qgtrain.evals import scoring
    from qgtrain.ops.load_model import load_model

    folder, run = trained
    export = folder / "cached"
    assert cli("export", str(run), "--out", str(export), cwd=folder).returncode == 0
    module, codec = load_model(export), tokenizer.load(str(export))
    prompts = ["gold. " * (i % 3) + f"{name} likes" for i, name in enumerate(NAMES)]
    argument = scoring.cache_argument(module)
    assert argument in ("cache", "past_key_values"), "transformers' name for it"
    eos, cpu, outputs = tokenizer.describe(str(export)).eos_id, torch.device("cpu"), {}
    for way in (None, argument):
        model = scoring.Model(
            module,
            codec,
            eos,
            window=32,
            device=cpu,
            precision="fp32",
            batch_size=8,
            lockstep=False,
            cache_argument=way,
        )
        outputs[way] = scoring.generate(model, prompts, 8, ["."])
    assert outputs[argument] == outputs[None]
    right = [out == FAVOURITE[name] for out, name in zip(outputs[None], NAMES)]
    assert sum(right) >= len(NAMES) // 2, outputs[None]


@pytest.mark.slow
def test_a_lora_runs_checkpoints_score_as_the_loop_scored_them(trained):
    """Its checkpoints hold the adapters (and their EMA) only: `qgtrain eval` builds the base again
    from the seed and puts them on it."""
    folder, _ = trained
    run = folder / "lora"
    lora = [
        "model.adapter=lora",
        "train.max_steps=40",
        "train.ema_decay=0.9",
        "train.eval_ema=true",
    ]
    assert cli(*train_args(folder, run, *lora), cwd=folder).returncode == 0
    loop = evaluated(run)[40]
    done = cli("eval", str(run), cwd=folder)
    assert done.returncode == 0, done.stderr
    alone = by_step(results(run))[40]
    for name in METRICS:
        assert alone[name] == pytest.approx(loop[name], abs=1e-6), name
    trained_only = cli("eval", str(run), "--set", "train.eval_ema=false", cwd=folder)
    assert trained_only.returncode == 0, trained_only.stderr
    assert by_step(results(run))[40]["eval_text_loss"] != loop["eval_text_loss"], "the EMA's"
    assert len({line["scored_as"] for line in results(run)}) == 6  # 3 tasks, 2 weights
    (run / "eval" / "results.jsonl").unlink()
    other_base = cli("eval", str(run), "--set", "train.seed=7", cwd=folder)
    said = other_base.stderr.strip().splitlines()[-1]
    assert other_base.returncode == 2 and said.startswith("qgtrain: error: "), said
    assert "was trained on" in said and "export" not in said


@pytest.mark.slow
def test_a_run_killed_mid_way_resumes_with_the_same_evaluation_records(trained):
    folder, reference = trained
    run = folder / "killed"
    pause = random.Random().uniform(0.0, 1.0)
    procs = start_cli_ranks(1, train_args(folder, run), folder, log_prefix="killed")
    wait_for(lambda: (run / "checkpoints" / f"step-{EVERY}").is_dir(), procs, "a checkpoint")
    time.sleep(pause)
    kill_ranks(procs)
    assert cli(*train_args(folder, run), cwd=folder).returncode == 0
    want, got = evaluated(reference), evaluated(run)
    assert want.keys() == got.keys()
    for step in want:
        assert {k: got[step][k] for k in METRICS} == {k: want[step][k] for k in METRICS}, pause
    for step in CHECKPOINTS[1:]:
        name = f"step-{step}.jsonl"
        assert (run / "eval" / name).read_text() == (reference / "eval" / name).read_text()


def test_bad_task_files_are_refused_in_one_line_naming_file_and_line(tmp_path):
    cases = {
        "multiple_choice": ('{"context": "a", "choices": ["x"], "label": 0}', "two or more"),
        "generate": ("not json", "not valid JSON"),
        "perplexity": ('{"text": 3}', "non-empty text field 'text'"),
    }
    for kind, (line, said) in cases.items():
        path = tmp_path / f"{kind}.jsonl"
        path.write_text(
            '{"context": "c", "choices": ["a", "b"], "label": 1, "prompt": "p", '
            '"text": "t"}\n' + line + "\n"
        )
        with pytest.raises(ConfigError) as caught:
            read_tasks(({"name": "t", "kind": kind, "files": [str(path)]},), 0)
        assert f"{path}:2" in str(caught.value) and said in str(caught.value), caught.value
    path = tmp_path / "label.jsonl"
    path.write_text('{"context": "c", "choices": ["a", "b"], "label": 2}\n')
    with pytest.raises(ConfigError, match=r"label.jsonl:1: 'label' must be the index"):
        read_tasks(({"name": "t", "kind": "multiple_choice", "files": [str(path)]},), 0)


@pytest.mark.slow
def test_a_bad_task_file_stops_training_before_a_step_and_harms_no_checkpoint(trained, tmp_path):
    folder, run = trained
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"context": "c", "choices": ["a", "b"], "label": 7}\n')
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    done = cli(
        *train_args(folder, run),
        f"eval.tasks=[{{name: facts, kind: multiple_choice, files: ['{bad}']}}]",
        "early_stopping.metric=val_loss",
        cwd=folder,
    )
    assert done.returncode == 2, done.stderr
    assert f"{bad}:1: 'label' must be the index" in one_error_line(done)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_tasks_that_cannot_be_scored_are_refused_by_the_config():
    with pytest.raises(ConfigError, match="eval.tasks: score a causal language model"):
        load_config(
            [],
            [
                "task.factory=tests.tasks:classifier",
                "eval.tasks=[{name: a, kind: perplexity, files: [x.jsonl]}]",
            ],
        )
    with pytest.raises(ConfigError, match="eval.tasks\\[0\\].kind: 'essay' is not a kind"):
        load_config([], ["eval.tasks=[{name: a, kind: essay, files: [x.jsonl]}]"])
    for files in ("[]", "3", "[x.jsonl, 4]"):
        with pytest.raises(ConfigError, match=r"eval.tasks\[0\].files: task 'a': expected a non"):
            load_config([], [f"eval.tasks=[{{name: a, kind: perplexity, files: {files}}}]"])
    twice = "[{name: a, kind: perplexity, files: [x.jsonl]}, {name: a, kind: generate, files: [y]}]"
    with pytest.raises(ConfigError, match=r"eval.tasks\[1\].name: task 'a' is named twice"):
        load_config([], [f"eval.tasks={twice}"])
    with pytest.raises(ConfigError, match="'eval_a_acc' is not reported by eval.tasks"):
        load_config([], ["early_stopping.metric=eval_a_acc"])
    cfg = load_config(
        [],
        [
            "eval.tasks=[{name: a, kind: multiple_choice, files: [x.jsonl]}]",
            "early_stopping.metric=eval_a_acc_norm",
            "early_stopping.mode=max",
        ],
    )
    assert cfg.early_stopping.metric == "eval_a_acc_norm"


def test_the_example_jobs_tasks_are_written_and_read(tmp_path, monkeypatch):
    example_eval_items(tmp_path)
    monkeypatch.chdir(tmp_path)  # the overlay names its files from the repository root
    cfg = load_config([ROOT / "config.yaml", ROOT / "jobs" / "eval.yaml"])
    tasks = read_tasks(cfg.eval.tasks, 0)
    assert [(t.name, t.kind, len(t.items)) for t in tasks] == [
        ("next_line", "multiple_choice", 6),
        ("complete", "generate", 6),
        ("modules", "perplexity", 6),
    ]
    first = tasks[0].items[0]
    assert first.choices[first.label] not in first.context.splitlines()[-1:]


def test_a_then_file_with_only_an_eval_section_ends_a_chain_by_scoring_the_stage_before(
    tmp_path, monkeypatch
):
    from qgtrain.launch.sbatch import render
    from qgtrain.launch.stages import plan

    monkeypatch.chdir(tmp_path)
    first = load_config([ROOT / "config.yaml"], [f"logging.runs_dir={tmp_path / 'runs'}"])
    (tmp_path / "tune.yaml").write_text("optim: {lr: 0.001}\n")
    (tmp_path / "score.yaml").write_text(
        "eval:\n  tasks: [{name: qa, kind: generate, files: [qa.jsonl]}]\n  max_new_tokens: 4\n"
    )
    stages = plan(first, [Path("tune.yaml"), Path("score.yaml")])
    assert [s.evaluates for s in stages] == [False, False, True]
    scoring = stages[2].cfg
    assert scoring.train.run_name == stages[1].cfg.train.run_name == "tiny-gpt2-stage2"
    assert scoring.optim.lr == 0.001 and scoring.eval.max_new_tokens == 4
    script = render(scoring.slurm, "stage-3.yaml", command="eval /runs/x --all")
    assert '-m qgtrain eval /runs/x --all "${args[@]}"' in script
    assert '-m qgtrain train "${args[@]}"' in render(first.slurm, "c.yaml")
    with pytest.raises(ConfigError, match="score.yaml: holds only an eval: section"):
        plan(first, [Path("score.yaml"), Path("tune.yaml")])
    (tmp_path / "none.yaml").write_text("eval:\n  max_new_tokens: 4\n")
    with pytest.raises(ConfigError, match="none.yaml: an evaluation stage .* needs eval.tasks"):
        plan(first, [Path("none.yaml")])
