"""Python a folder names runs only where the user trusts it and the folder is theirs alone: a
transformers folder's `auto_map` (or a model_type transformers does not know) behind
model.pretrained or an export, and lm-evaluation-harness task YAMLs' `!function` under
--include-path. transformers' "run the custom code? [y/N]" prompt is never reached. Runs against:
real `qgtrain train` and `qgtrain eval --harness` processes with "y" on their stdin, load_model in
this one, a GPT-2 saved by transformers, planted modules that leave a mark when imported (the
witness that their code ran), a folder chown'd to the real user `nobody`, and the package's
source (ast)."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qgtrain.config.load import config_to_dict, load_config
from qgtrain.foundation.folder_code import remote_code
from qgtrain.foundation.trust import UntrustedCode
from qgtrain.ops.load_model import load_model
from tests.helpers import byte_config, one_error_line, train_command
from tests.ranks import ROOT

PACKAGE = ROOT / "qgtrain"
AUTO_MAP = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
EVIL = """from pathlib import Path

Path({marker!r}).write_text("ran")

from transformers import GPT2Config, GPT2LMHeadModel


class EvilConfig(GPT2Config):
    model_type = {model_type!r}


class EvilModel(GPT2LMHeadModel):
    config_class = EvilConfig
"""


def evil_folder(folder: Path, marker: Path, model_type: str = "gpt2") -> Path:
    """A tiny GPT-2 as save_pretrained writes it, then a config.json naming the folder's own
    evil.py, which marks `marker` when imported. A model_type transformers does not know is what
    made it ask on stdin."""
    import torch
    import transformers

    config = byte_config("gpt2", n_positions=32)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    saved.update(auto_map=AUTO_MAP, model_type=model_type)
    (folder / "config.json").write_text(json.dumps(saved))
    (folder / "evil.py").write_text(EVIL.format(marker=str(marker), model_type=model_type))
    return folder


def answering_yes(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m qgtrain ARGS` with "y" waiting on its stdin, as a user who would say yes."""
    return subprocess.run(
        [sys.executable, "-m", "qgtrain", *args],
        cwd=cwd,
        input="y\ny\n",
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.fixture
def modules_cache(tmp_path, monkeypatch):
    """transformers copies a folder's code here before importing it: a cache of the test's own."""
    import transformers.dynamic_module_utils as dynamic

    monkeypatch.setattr(dynamic, "HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr(sys, "path", list(sys.path))


@pytest.mark.slow
@pytest.mark.parametrize("model_type", ["gpt2", "evil"])
def test_training_never_runs_code_model_pretrained_names_whatever_stdin_says(tmp_path, model_type):
    marker = tmp_path / "ran"
    folder = evil_folder(tmp_path / f"pretrained-{model_type}", marker, model_type)
    done = answering_yes(
        *train_command(
            tmp_path / "run",
            f"model.pretrained={folder}",
            "data.name=synthetic",
            "data.seq_len=16",
            "data.synthetic_samples=64",
            "train.max_steps=1",
            "logging.tensorboard=false",
        ),
        cwd=tmp_path,
    )
    line = one_error_line(done)
    assert line == (
        f"qgtrain: error: model.pretrained: {folder}/config.json names code for transformers to "
        f"import from {folder} (auto_map: evil.EvilConfig, evil.EvilModel), which would run as "
        "you; it was not run. HINT: training has no --trust-code and runs no code from the "
        "folders it reads: give a folder of a model transformers builds itself (a model_type it "
        "knows, no auto_map in config.json or tokenizer_config.json)"
    )
    assert "custom code" not in done.stdout + done.stderr, "transformers never asked"
    assert not marker.exists()


def test_an_export_naming_code_loads_its_transformers_class_only_with_trust_code(tmp_path):
    marker = tmp_path / "ran"
    folder = evil_folder(tmp_path / "export", marker)
    meta = {"kind": "transformers", "class": "transformers.GPT2LMHeadModel"}
    (folder / "qgtrain_model.json").write_text(json.dumps(meta))
    with pytest.raises(UntrustedCode) as refused:
        load_model(folder)
    assert str(refused.value) == (
        f"load_model: {folder}/config.json names code for transformers to import from {folder} "
        "(auto_map: evil.EvilConfig, evil.EvilModel), which would run as you; it was not run. "
        f"HINT: read it; pass trust_code=True if you trust {folder}'s code"
    )
    assert type(load_model(folder, trust_code=True)).__name__ == "GPT2LMHeadModel"
    assert not marker.exists(), "a transformers class runs no code from the folder"


def rebuilt_export(tmp_path: Path, pretrained: Path) -> Path:
    """An export whose qgtrain_model.json rebuilds the built-in model from `pretrained`, with
    that folder's weights: what a colleague's export folder can say."""
    folder = tmp_path / "export"
    folder.mkdir()
    cfg = load_config([], [f"model.pretrained={pretrained}", "data.seq_len=16"])
    meta = {"kind": "state_dict", "class": "evil.EvilModel", "config": config_to_dict(cfg)}
    (folder / "qgtrain_model.json").write_text(json.dumps(meta))
    shutil.copy(pretrained / "model.safetensors", folder)
    return folder


def test_an_export_rebuilt_from_model_pretrained_runs_its_code_only_when_trusted(
    tmp_path, modules_cache
):
    marker = tmp_path / "ran"
    pretrained = evil_folder(tmp_path / "pretrained_rebuilt", marker, "evil")
    export = rebuilt_export(tmp_path, pretrained)
    with pytest.raises(UntrustedCode, match=r"^model.pretrained: .*\(auto_map: evil.EvilConfig"):
        load_model(export)
    assert not marker.exists()

    model = load_model(export, trust_code=True)  # the code path of a trusted folder still works
    assert type(model).__name__ == "EvilModel" and marker.read_text() == "ran"


def test_trusted_code_runs_only_from_a_folder_no_one_else_can_write(tmp_path, modules_cache):
    marker = tmp_path / "ran"
    pretrained = evil_folder(tmp_path / "pretrained_shared", marker, "evil")
    export = rebuilt_export(tmp_path, pretrained)
    (pretrained / "evil.py").chmod(0o664)
    with pytest.raises(UntrustedCode) as refused:
        load_model(export, trust_code=True)
    assert f"and {pretrained}/evil.py is writable by its group, so what runs may not" in str(
        refused.value
    )
    assert not marker.exists()


def test_a_tokenizer_folder_naming_code_is_refused_and_a_plain_one_is_told_false(tmp_path):
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert remote_code(folder, "data.tokenizer") is False
    auto_map = {"AutoTokenizer": ["evil.SlowTokenizer", "evil.FastTokenizer"]}
    (folder / "tokenizer_config.json").write_text(json.dumps({"auto_map": auto_map}))
    with pytest.raises(UntrustedCode, match=r"tokenizer_config.json names code .*FastTokenizer\)"):
        remote_code(folder, "data.tokenizer")


# from_pretrained calls that take no trust_remote_code, each with its reason
UNTOLD = {
    ("ops/load_model.py", "_hub_model"): "huggingface_hub's mixin: config.json is init arguments",
}


def from_pretrained_calls() -> dict[tuple[str, str, int], bool]:
    """Every `X.from_pretrained(...)` call in qgtrain: (file, innermost function, line) and
    whether it passes trust_remote_code."""
    calls: dict[int, tuple[str, str, int, bool]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        where = str(path.relative_to(PACKAGE))
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):  # outer functions first: the innermost wins
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "from_pretrained"
                ):
                    told = any(k.arg == "trust_remote_code" for k in node.keywords)
                    calls[id(node)] = (where, function.name, node.lineno, told)
    return {(where, name, line): told for where, name, line, told in calls.values()}


def test_every_from_pretrained_call_tells_transformers_whether_to_trust_remote_code():
    calls = from_pretrained_calls()
    untold = sorted(
        (where, name, line)
        for (where, name, line), told in calls.items()
        if not told and (where, name) not in UNTOLD
    )
    assert not untold, f"from_pretrained without trust_remote_code (it would prompt): {untold}"
    sites = {(where, name) for where, name, _ in calls}
    assert set(UNTOLD) <= sites, "an exemption for a call that is gone"
    assert {("tasks/pretrained.py", "load_pretrained"), ("data/chat.py", "renderer")} <= sites


def harness_tasks(folder: Path, marker: Path) -> Path:
    """A task YAML whose process_docs is `!function utils.process_docs`, and a utils.py that marks
    `marker` when imported."""
    folder.mkdir()
    (folder / "planted.yaml").write_text(
        "task: planted\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {folder}/items.jsonl\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        "process_docs: !function utils.process_docs\n"
        "doc_to_text: context\n"
        "doc_to_choice: choices\n"
        "doc_to_target: label\n"
        "metric_list:\n  - metric: acc\n"
    )
    (folder / "items.jsonl").write_text('{"context": "a", "choices": ["b", "c"], "label": 0}\n')
    (folder / "utils.py").write_text(
        f"from pathlib import Path\n\nPath({str(marker)!r}).write_text('ran')\n\n\n"
        "def process_docs(dataset):\n    return dataset\n"
    )
    return folder


def harness(tmp_path: Path, tasks: Path, *more: str) -> subprocess.CompletedProcess[str]:
    export = tmp_path / "export"
    return answering_yes(
        "eval",
        str(export),
        "--harness",
        "planted",
        "--include-path",
        str(tasks),
        *more,
        cwd=tmp_path,
    )


@pytest.mark.slow
def test_include_path_is_code_read_only_with_trust_code(tmp_path):
    marker = tmp_path / "ran"
    tasks = harness_tasks(tmp_path / "tasks", marker)
    line = one_error_line(harness(tmp_path, tasks))
    assert line == (
        f"qgtrain: error: eval --harness: --include-path {tasks} holds task YAMLs, whose "
        "`!function` tags make lm-eval import Python from it, which would run as you; it was not "
        f"run. HINT: read it; pass --trust-code if you trust {tasks}'s code"
    )
    trusted = one_error_line(harness(tmp_path, tasks, "--trust-code"))
    assert "is not an export folder" in trusted, "past the folder's check, to the export's"
    assert not marker.exists()


@pytest.mark.slow
def test_include_path_others_can_write_is_refused_even_with_trust_code(tmp_path):
    marker = tmp_path / "ran"
    tasks = harness_tasks(tmp_path / "tasks", marker)
    tasks.chmod(0o777)
    line = one_error_line(harness(tmp_path, tasks, "--trust-code"))
    assert f", and {tasks} is writable by its group and others, so what runs may not" in line
    assert line.endswith(
        "HINT: use a copy of your own (cp -rL) that no one else can write "
        "(chmod -R g-w,o-w), once you have read its code"
    )
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to give the folder to the user nobody")
def test_include_path_of_another_user_is_refused_even_with_trust_code(tmp_path):
    marker = tmp_path / "ran"
    tasks = harness_tasks(tmp_path / "tasks", marker)
    shutil.chown(tasks / "utils.py", user="nobody")
    line = one_error_line(harness(tmp_path, tasks, "--trust-code"))
    uid = tasks.joinpath("utils.py").stat().st_uid
    assert f", and {tasks}/utils.py belongs to uid {uid}, not to you (uid 0)" in line
    assert not marker.exists()
