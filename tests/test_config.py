"""Config loading, validation and --set conversion. Runs against: pure values and real YAML files;
the CLI battery runs `python -m qgtrain` as a subprocess (fast: config errors come before torch is
imported)."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qgtrain.config import SECTIONS, RunConfig, SlurmConfig
from qgtrain.config.load import (
    config_from_dict,
    config_to_dict,
    dump_yaml,
    load_config,
    with_overrides,
)
from qgtrain.foundation.errors import ConfigError
from tests.helpers import fresh_cli

ROOT = Path(__file__).resolve().parents[1]


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_config_yaml_equals_the_schema_defaults_and_comments_every_key():
    assert load_config([ROOT / "config.yaml"]) == RunConfig()
    text = (ROOT / "config.yaml").read_text()
    blocks = dict(re.findall(r"^(\w+):\n((?:[ #].*\n|\n)*)", text, re.MULTILINE))
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            line = re.search(rf"^  {f.name}: .*?  # (.+)$", blocks.get(section, ""), re.MULTILINE)
            assert line, f"{section}.{f.name} is missing or uncommented in config.yaml"
            assert line.group(1) == f.metadata["doc"], (
                f"{section}.{f.name}: config.yaml's comment is not the field's doc in "
                "qgtrain/config/"
            )


def test_overlays_merge_key_by_key_and_set_wins(tmp_path):
    base = write(tmp_path, "train:\n  max_steps: 10\n  seed: 3\noptim:\n  lr: 0.01\n", "base.yaml")
    overlay = write(tmp_path, "train:\n  max_steps: 20\n", "overlay.yaml")
    cfg = load_config([base, overlay], ["optim.lr=3e-4"])
    assert (cfg.train.max_steps, cfg.train.seed, cfg.optim.lr) == (20, 3, 3e-4)


@pytest.mark.parametrize(
    "assignment, key, expected",
    [
        ("train.max_steps=1_000", "train.max_steps", 1000),
        ("optim.lr=3e-4", "optim.lr", 3e-4),
        ("optim.lr=1", "optim.lr", 1.0),
        ("train.find_unused_parameters=yes", "train.find_unused_parameters", True),
        ("train.find_unused_parameters=False", "train.find_unused_parameters", False),
        ("model.pretrained=null", "model.pretrained", None),
        ("model.pretrained=/models/gpt2", "model.pretrained", "/models/gpt2"),
        (
            "slurm.setup=['module load cuda', 'echo hi']",
            "slurm.setup",
            ("module load cuda", "echo hi"),
        ),
        ("slurm.time=90", "slurm.time", "90"),
        ("train.precision=bf16", "train.precision", "bf16"),
        ("model.compile=true", "model.compile", True),
        ("model.compile=off", "model.compile", False),
        ("model.compile=auto", "model.compile", "auto"),
    ],
)
def test_set_converts_text_to_the_field_type(assignment, key, expected):
    section, name = key.split(".")
    value = getattr(getattr(load_config([], [assignment]), section), name)
    assert value == expected and type(value) is type(expected)


def test_yaml_reading_of_3e_minus_4_as_text_is_still_a_float(tmp_path):
    assert load_config([write(tmp_path, "optim:\n  lr: 3e-4\n")]).optim.lr == 3e-4


@pytest.mark.parametrize(
    "written, expected",
    [
        ("1e3", 1000),
        ("1.5e3", 1500),
        ("2000.0", 2000),
        ("1_000", 1000),
        ("32.5", "train.max_steps: 32.5 is not an integer; expected an integer >= 1"),
        ("1e-3", "train.max_steps: 1e-3 is not an integer; expected an integer >= 1"),
        ("1e400", "train.max_steps: 1e400 is not an integer; expected an integer >= 1"),
        ("many", "train.max_steps: expected an integer >= 1, got text ('many')"),
    ],
)
@pytest.mark.parametrize("source", ["yaml", "--set"])
def test_an_integer_key_takes_a_whole_number_in_any_notation(tmp_path, source, written, expected):
    """1e3 (text to YAML: no dot) is 1000 wherever it is written; 32.5 or 1e-3 is no integer."""

    def load() -> RunConfig:
        if source == "--set":
            return load_config([], [f"train.max_steps={written}"])
        return load_config([write(tmp_path, f"train:\n  max_steps: {written}\n")])

    if isinstance(expected, int):
        value = load().train.max_steps
        assert value == expected and type(value) is int
        return
    with pytest.raises(ConfigError) as refused:
        load()
    said = str(refused.value)
    assert expected in said and "\n" not in said, said


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            "train:\n  max_step: 5\n",
            r"c.yaml: unknown key 'train.max_step'. Did you mean 'train.max_steps'\? Valid keys",
        ),
        ("trian:\n  seed: 1\n", r"unknown section 'trian'. Did you mean 'train'\?"),
        ("train:\n  lr: 0.1\n", r"unknown key 'train.lr'. 'lr' is a key of optim."),
        (
            "train:\n  batch_size: -4\n",
            r"train.batch_size: -4 is out of range; expected an integer >= 1",
        ),
        (
            "train:\n  batch_size: 2.5\n",
            r"train.batch_size: 2.5 is not an integer; expected an integer >= 1",
        ),
        (
            "train:\n  batch_size: many\n",
            r"train.batch_size: expected an integer >= 1, got text \('many'\)",
        ),
        (
            "train:\n  precision: half\n",
            r"train.precision: 'half' is not allowed; choose one of auto, fp32, bf16, fp16",
        ),
        ("train:\n  find_unused_parameters: 1\n", r"expected true or false, got int \(1\)"),
        (
            "optim:\n  beta2: 1.5\n",
            r"optim.beta2: 1.5 is out of range; expected a number between 0.0 and 1.0",
        ),
        ("optim:\n  lr: .nan\n", r"optim.lr: nan is out of range"),
        ("slurm:\n  setup: module load cuda\n", r"slurm.setup: expected a list of text items"),
        ("train: 5\n", r"train: expected a mapping of keys, got int \(5\)"),
        ("- a\n- b\n", r"the top level must be a mapping of sections"),
        ("train: {batch_size: 8\n", r"not valid YAML at line 2"),
        (
            "checkpoint:\n  keep_last: 1\n",
            r"checkpoint.keep_last: 1 is below 2: the newest checkpoint may be half-written",
        ),
        ("optim:\n  lr: 0.001\n  min_lr: 0.01\n", r"optim.min_lr: 0.01 is above optim.lr=0.001"),
        (
            "model:\n  hidden: 100\n  heads: 3\n",
            r"model.hidden: 100 is not divisible by model.heads=3",
        ),
        (
            "model:\n  factory: mymodels.make\n",
            r"model.factory: 'mymodels.make' is not of the form 'package.module:function'",
        ),
        (
            "model:\n  factory: a:b\n  pretrained: /x\n",
            r"set either model.pretrained or model.factory, not both",
        ),
        ("data:\n  name: factory\n", r"data.factory: data.name is 'factory' but no"),
        ("train:\n  run_name: a/b\n", r"train.run_name: 'a/b' must be a plain directory name"),
        (
            "train:\n  shard_group_size: 4\n",
            r"train.shard_group_size: applies to train.parallel: hsdp, not ddp",
        ),
        ("train:\n  parallel: hsdp\n  precision: fp16\n", r"use bf16 with train.parallel: hsdp"),
        (
            "early_stopping:\n  patience: 3\ntrain:\n  eval_every: 0\n",
            r"early stopping needs validations",
        ),
        (
            "train:\n  seed: 99999999999999999999\n",
            r"train.seed: 99999999999999999999 is out of range; expected an "
            r"integer between 0 and 2147483647",
        ),
        (
            "train:\n  collective_timeout_s: 1.0e+12\n",
            r"train.collective_timeout_s: 1000000000000.0 is out of range",
        ),
        (
            "train:\n  run_name: ' '\n",
            r"train.run_name: ' ' must be a plain directory name: not empty",
        ),
        ("train:\n  run_name: ' x'\n", r"no leading or trailing spaces"),
        (
            "early_stopping:\n  metric: test_accuracy\n",
            r"early_stopping.metric: 'test_accuracy' is not a validation",
        ),
        ("early_stopping:\n  mode: biggest\n", r"'biggest' is not allowed; choose one of min, max"),
        (
            "task: mytasks.make\n",
            r"task.factory: 'mytasks.make' is not of the form 'package.module:function' or "
            r"'path/to/file.py:function'",
        ),
        ("task:\n  options: [1, 2]\n", r"task.options: expected a mapping of names to values"),
        ("slurm:\n  job_name: null\n", r"slurm.job_name: expected text, got NoneType"),
        (
            "train:\n  max_time: soon\n",
            r"train.max_time: 'soon' is not a duration; use e.g. 45m, 3h30m",
        ),
        (
            "train:\n  precision: bf61\n",
            r"train.precision: 'bf61' is not allowed; choose one of auto, fp32, bf16, fp16. "
            r"Did you mean 'bf16'\?",
        ),
        (
            "train:\n  parallel: fsdp\n  precision: fp16\n",
            r"train.precision: fp16 needs loss scaling, which qgtrain "
            r"does not do on sharded gradients; use bf16",
        ),
        (
            "slurm:\n  step_retries: -1\n",
            r"slurm.step_retries: -1 is out of range; expected an integer between 0 and 10",
        ),
        (
            "slurm:\n  step_retries: 1000\n",
            r"slurm.step_retries: 1000 is out of range; expected an integer between 0 "
            r"and 10",
        ),
        (
            "checkpoint: {local_every_steps: often}\n",
            r"checkpoint.local_every_steps: expected auto, or an integer >= 0; got text "
            r"\('often'\)",
        ),
        (
            "slurm: {nodes: 2, min_nodes: 3}\n",
            r"slurm.min_nodes: 3 is more than slurm.nodes \(2\)",
        ),
        (
            "slurm: {nodes: 4, min_nodes: 3}\n",
            r"slurm.min_nodes: 3 node\(s\) cannot keep the global batch of slurm.nodes \(4\) "
            r"with train.grad_accum_steps 1: each rank would take 4/3 micro-batches a step. "
            r"Allowed: a min_nodes that divides 4",
        ),
    ],
)
def test_bad_files_name_the_file_the_key_and_what_is_allowed(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=expected) as caught:
        load_config([path])
    assert str(caught.value).startswith(f"{path}: "), "the message names the file first"


def test_one_entry_of_a_mapping_setting_is_set_on_its_own_and_checked_with_the_mapping(tmp_path):
    """`--set optim.args.momentum=0.9`, as qgtrain's own messages name the key: merged into the
    file's mapping and earlier --set entries, then checked whole (a misspelled entry named)."""
    file = write(tmp_path, "optim:\n  name: sgd\n  args: {nesterov: true, momentum: 0.5}\n")
    assert load_config([], ["optim.name=sgd", "optim.args.momentum=0.9"]).optim.args == {
        "momentum": 0.9
    }
    cfg = load_config([file], ["optim.args.momentum=0.9", "optim.args.dampening=0"])
    assert cfg.optim.args == {"nesterov": True, "momentum": 0.9, "dampening": 0}
    assert with_overrides(cfg, ["optim.args.momentum=0.8"]).optim.args["momentum"] == 0.8
    with pytest.raises(ConfigError, match=r"--set: optim.args.momentun: .*Did you mean 'momentum'"):
        load_config([file], ["optim.args.momentun=0.9"])
    with pytest.raises(ConfigError, match=r"unknown key 'optim.args.a.b'"):
        load_config([file], ["optim.args.a.b=1"])


def test_null_for_an_optional_text_is_its_empty_default_and_a_task_is_named_in_one_line(tmp_path):
    cfg = load_config(
        [write(tmp_path, "slurm:\n  partition: null\n  account: ~\ntask: jobs/t.py:make\n")],
        ["task.options.hidden=64", "task.options.name=tiny"],
    )
    assert cfg.slurm.partition == "" and cfg.slurm.account == ""
    assert cfg.task.factory == f"{(tmp_path / 'jobs' / 't.py').resolve()}:make", (
        "relative to the file naming it"
    )
    assert cfg.task.options == {"hidden": 64, "name": "tiny"}
    assert load_config([], ["task=my.mod:build"]).task.factory == "my.mod:build"


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("3h30m", 12600),
        ("45m", 2700),
        ("90s", 90),
        ("1d2h", 93600),
        ("2:00:00", 7200),
        ("1-12", 129600),
        ("90", 5400),
        ("0", None),
        ("x", None),
    ],
)
def test_durations_in_units_or_slurm_forms(text, seconds):
    from qgtrain.foundation.durations import duration_s

    assert duration_s(text) == seconds


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope.yaml: config file not found"):
        load_config([tmp_path / "nope.yaml"])


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(
        [], ["slurm.extra_sbatch=['--exclusive']", "model.dropout=0.1", "train.seed=7"]
    )
    assert config_from_dict(yaml.safe_load(dump_yaml(cfg)), "run dir") == cfg
    assert config_to_dict(cfg)["slurm"]["extra_sbatch"] == ["--exclusive"]


BAD_CLI = [
    (
        ["--set", "train.max_step=5"],
        "unknown key 'train.max_step'. Did you mean 'train.max_steps'?",
    ),
    (["--set", "train.batch_size=0"], "train.batch_size: 0 is out of range"),
    (["--set", "train.batch_size=32.5"], "train.batch_size: 32.5 is not an integer"),
    (["--set", "optim.lr=fast"], "optim.lr: expected a number >= 0.0, got text ('fast')"),
    (["--set", "train.precision=fp8"], "train.precision: 'fp8' is not allowed"),
    (["--set", "train.seed"], "--set 'train.seed': expected KEY=VALUE"),
    (["--set", "=3"], "--set '=3': expected KEY=VALUE"),
    (["--set", "checkpoint.keep_last=1"], "checkpoint.keep_last: 1 is below 2"),
    (["--config", "/nonexistent/config.yaml"], "/nonexistent/config.yaml: config file not found"),
]


@pytest.mark.parametrize("args, message", BAD_CLI)
def test_cli_reports_bad_config_in_one_line_with_exit_code_2(tmp_path, args, message):
    result = fresh_cli("train", *args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("qgtrain: error: ") and message in result.stderr
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists(), "a rejected config must not create a run directory"


def test_cli_debug_shows_the_traceback(tmp_path):
    result = fresh_cli("--debug", "config", "--set", "train.x=1", cwd=tmp_path)
    assert (
        result.returncode != 0 and "Traceback" in result.stderr and "ConfigError" in result.stderr
    )


def test_version_is_printed_at_once_without_torch():
    from qgtrain import __version__

    code = (
        "import sys\nfrom qgtrain.interface.cli import main\ntry:\n    main(['--version'])\n"
        "except SystemExit as stop:\n    print(stop.code, "
        "sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout == f"qgtrain {__version__}\n0 []\n", result.stderr
    shell = subprocess.run(
        [sys.executable, "-m", "qgtrain", "--version"], capture_output=True, text=True
    )
    assert shell.returncode == 0 and shell.stdout == f"qgtrain {__version__}\n"


def test_config_get_prints_one_value(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "qgtrain",
            "config",
            "--get",
            "data.cache_dir",
            "--set",
            "data.cache_dir=/tmp/x",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0 and result.stdout == "/tmp/x\n"


def test_a_resolved_config_with_overrides_is_not_turned_into_text_and_back():
    """qgtrain.submit(RunConfig, **overrides): the given values stay what they are (a folder named
    'None' used to come back as no folder at all), and the overrides are validated with them."""
    import dataclasses

    from qgtrain.config.load import with_overrides

    given = dataclasses.replace(
        RunConfig(),
        model=dataclasses.replace(RunConfig().model, pretrained="None"),
        task=dataclasses.replace(RunConfig().task, options={"deep": {"list": [1, 2]}}),
    )
    cfg = with_overrides(given, ["train.max_steps=5", "task.options.extra=3"])
    assert cfg.model.pretrained == "None" and cfg.train.max_steps == 5
    assert cfg.task.options == {"deep": {"list": [1, 2]}, "extra": 3}
    with pytest.raises(ConfigError, match=r"train.max_steps: 0 is out of range"):
        with_overrides(given, ["train.max_steps=0"])


@pytest.mark.parametrize(
    "nodes, min_nodes, accumulate, ranks, expected",
    [
        (2, 1, 1, 2, 1),  # the planned size
        (2, 1, 1, 1, 2),  # one node of two: twice the micro-batches
        (4, 2, 3, 4, 6),  # two nodes (4 ranks of 8) of four, each rank's three doubled
        (4, 2, 3, 6, 4),  # three of four: 24 micro-batches among six ranks
        (2, 0, 1, 1, 1),  # no min_nodes: a smaller step keeps its own batch
        (2, 1, 1, 4, 1),  # more ranks than planned: left as configured
    ],
)
def test_a_step_on_fewer_nodes_accumulates_the_global_batch_of_slurm_nodes(
    nodes, min_nodes, accumulate, ranks, expected
):
    from qgtrain.config.slurm import micro_batches

    slurm = SlurmConfig(nodes=nodes, min_nodes=min_nodes, tasks_per_node=2 if nodes == 4 else 1)
    assert micro_batches(slurm, accumulate, ranks) == expected


def test_a_step_whose_ranks_cannot_share_the_global_batch_is_refused():
    from qgtrain.config.slurm import micro_batches

    with pytest.raises(ConfigError, match=r"a step on 3 rank\(s\) cannot keep .* 4/3 micro"):
        micro_batches(SlurmConfig(nodes=4, min_nodes=2), 1, 3)


def test_a_number_or_a_word_takes_either_from_a_file_and_from_set(tmp_path):
    """checkpoint.local_every_steps: an integer, or auto."""
    local = "checkpoint.local_dir=/tmp/x"
    file = write(tmp_path, "checkpoint: {local_dir: /tmp/x, local_every_steps: auto}\n")
    assert load_config([file]).checkpoint.local_every_steps == "auto"
    assert (
        load_config([], [local, "checkpoint.local_every_steps=auto"]).checkpoint.local_every_steps
        == "auto"
    )
    assert (
        load_config([], [local, "checkpoint.local_every_steps=20"]).checkpoint.local_every_steps
        == 20
    )
