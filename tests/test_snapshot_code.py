"""The code a job runs and the stages that follow it, without a cluster. Runs against: real folders
and git repositories under tmp_path, `qgtrain submit --dry-run`, `qgtrain snapshot` and `qgtrain
next-stage` as subprocesses, and a stand-in for sbatch (a script that counts its calls). The same on
the test cluster: test_slurm_stages.py."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qgtrain.config.load import load_config
from qgtrain.foundation.errors import ConfigError
from qgtrain.launch import codesnap, stages
from qgtrain.launch.runfrom import job_config, snapshot
from tests.helpers import cli, stand_in_sbatch

ROOT = Path(__file__).resolve().parents[1]


def submit_dir(tmp_path: Path) -> Path:
    """A user's folder: a task module, a config, data beside them, and an earlier run's files."""
    folder = tmp_path / "project"
    (folder / "runs" / "old").mkdir(parents=True)
    (folder / ".venv").mkdir()
    (folder / "my_task.py").write_text("VALUE = 1\n")
    (folder / "config.yaml").write_text("train: {run_name: demo}\nlogging: {runs_dir: runs}\n")
    (folder / "data.bin").write_bytes(b"\0" * 1000)
    (folder / "runs" / "old" / "status.json").write_text("{}")
    (folder / ".venv" / "site.py").write_text("")
    return folder


def names(files: codesnap.Files) -> set[str]:
    return {name for name, _ in files.entries if name.startswith("submit/")}


def test_without_git_code_files_and_qgtrain_are_collected_not_data_runs_or_hidden(tmp_path):
    folder = submit_dir(tmp_path)
    files = codesnap.collect(folder, (folder / "runs",))
    assert names(files) == {"submit/my_task.py", "submit/config.yaml"} and not files.git
    assert "lib/qgtrain/launch/codesnap.py" in {name for name, _ in files.entries}


def test_with_git_tracked_and_unignored_files_are_collected_and_the_diff_recorded(tmp_path):
    folder = submit_dir(tmp_path)
    (folder / ".gitignore").write_text("runs/\n*.bin\n.venv/\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], cwd=folder, check=True)
    subprocess.run([*git, "add", "my_task.py", ".gitignore"], cwd=folder, check=True)
    subprocess.run([*git, "commit", "-qm", "first"], cwd=folder, check=True)
    (folder / "my_task.py").write_text("VALUE = 2\n")
    (folder / "notes.txt").write_text("untracked, not ignored\n")
    assert names(codesnap.collect(folder)) == {
        "submit/.gitignore",
        "submit/my_task.py",
        "submit/config.yaml",
        "submit/notes.txt",
    }
    code = codesnap.take(folder, tmp_path / "code", 50)
    record = codesnap.read_record(code.folder)
    assert record["hash"] == code.digest and record["git"] is True
    assert len(str(record["commit"])) == 40
    assert "-VALUE = 1\n+VALUE = 2" in str(record["diff"])


def test_a_link_is_kept_as_a_link_and_what_it_points_at_is_never_copied(tmp_path):
    folder = submit_dir(tmp_path)
    (tmp_path / "secret").write_text("a key from the home folder\n")
    (folder / "helper.py").symlink_to(tmp_path / "secret")
    code = codesnap.take(folder, tmp_path / "code", 50, (folder / "runs",))
    kept = code.folder / "submit" / "helper.py"
    assert kept.is_symlink() and os.readlink(kept) == str(tmp_path / "secret")
    copied = [p for p in code.folder.rglob("*") if p.is_file() and not p.is_symlink()]
    assert not any(p.read_bytes() == b"a key from the home folder\n" for p in copied)


def test_the_snapshot_is_content_addressed_reused_unchanged_and_new_after_an_edit(tmp_path):
    folder = submit_dir(tmp_path)
    first = codesnap.take(folder, tmp_path / "code", 50, (folder / "runs",))
    made = (first.folder / codesnap.RECORD).stat().st_mtime_ns
    again = codesnap.take(folder, tmp_path / "code", 50, (folder / "runs",))
    assert again == first, "found by its hash"
    assert (first.folder / codesnap.RECORD).stat().st_mtime_ns == made, "nothing copied"
    assert (first.workdir / "my_task.py").read_text() == "VALUE = 1\n"
    assert (first.lib / "qgtrain" / "launch" / "codesnap.py").is_file()
    (folder / "my_task.py").write_text("VALUE = 3\n")
    edited = codesnap.take(folder, tmp_path / "code", 50, (folder / "runs",))
    assert edited.digest != first.digest
    assert (first.workdir / "my_task.py").read_text() == "VALUE = 1\n"
    kept = sorted(p.name for p in (tmp_path / "code").iterdir())
    assert kept == sorted([first.digest, edited.digest])


def test_the_job_config_anchors_relative_paths_and_points_file_factories_at_the_snapshot(tmp_path):
    folder = submit_dir(tmp_path)
    cfg = load_config(
        [folder / "config.yaml"],
        [
            "data.cache_dir=cache",
            f"task.factory={folder}/my_task.py:make",
            "data.tokenizer=byte",
            "model.pretrained=models/base",
        ],
    )
    code = snapshot(cfg, folder, tmp_path / "code")
    moved = job_config(cfg, folder, code)
    assert moved.logging.runs_dir == str(folder / "runs")
    assert moved.data.cache_dir == str(folder / "cache") and moved.data.tokenizer == "byte"
    assert moved.model.pretrained == str(folder / "models" / "base")
    assert moved.task.factory == f"{code.workdir / 'my_task.py'}:make"


def test_a_snapshot_over_the_cap_is_one_line_exit_2_naming_the_largest_file(tmp_path):
    folder = submit_dir(tmp_path)
    (folder / "weights.json").write_text("0" * 3_000_000)
    result = cli(
        "submit",
        "--dry-run",
        "--config",
        "config.yaml",
        "--set",
        "slurm.snapshot_max_mb=2",
        cwd=folder,
    )
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    # 3 MB of weights and the package (lib/qgtrain, whose size changes with every feature)
    assert re.match(
        r"qgtrain: error: slurm.snapshot_max_mb: the code snapshot would be [34]\.\d MB, over the "
        r"cap of 2 MB",
        result.stderr,
    ), result.stderr
    assert "largest: weights.json (3.0 MB)" in result.stderr
    assert not (folder / "runs" / "demo").exists()


def test_the_dry_run_shows_the_job_running_its_snapshot_and_the_opt_out_leaves_it_out(tmp_path):
    folder = submit_dir(tmp_path)
    shown = cli("submit", "--dry-run", "--config", "config.yaml", cwd=folder)
    digest = codesnap.digest(codesnap.collect(folder, (folder / "runs", folder / "jobs" / "out")))
    code = f"{folder}/runs/demo/code/{digest}"
    assert f"\ncd {folder} || exit 1  # submitted here" in shown.stdout, shown.stderr
    assert f"\nexport PYTHONPATH={code}/lib:{code}/submit" in shown.stdout
    off = cli(
        "submit",
        "--dry-run",
        "--config",
        "config.yaml",
        "--set",
        "slurm.snapshot=false",
        cwd=folder,
    )
    between = off.stdout.split("recover_args")[0].split("RECOVER_PYTHON")[1]
    assert off.returncode == 0 and "code" not in between
    assert not (folder / "runs" / "demo").exists(), "a dry run copies nothing"


def test_train_slurm_snapshots_at_a_jobs_first_start_and_reuses_it_on_requeue(tmp_path):
    folder = submit_dir(tmp_path)
    first = cli("snapshot", "--config", "config.yaml", "--job", "41", cwd=folder)
    workdir, pythonpath, config = first.stdout.splitlines()
    (folder / "my_task.py").write_text("raise SyntaxError\n")
    (folder / "config.yaml").write_text(
        "train: {run_name: demo, max_steps: 7}\nlogging: {runs_dir: runs}\n"
    )
    requeued = cli("snapshot", "--config", "config.yaml", "--job", "41", cwd=folder)
    assert requeued.stdout == first.stdout, "a requeue runs the first attempt's code and config"
    assert (Path(workdir) / "my_task.py").read_text() == "VALUE = 1\n"
    assert pythonpath.startswith(f"{Path(workdir).parent / 'lib'}:{workdir}")
    assert "max_steps: 7" not in Path(config).read_text()
    assert "runs_dir: " + str(folder / "runs") in Path(config).read_text()
    another = cli("snapshot", "--config", "config.yaml", "--job", "42", cwd=folder)
    assert another.stdout.splitlines()[0] != workdir, "a new job takes the code as it is now"
    off = cli(
        "snapshot",
        "--config",
        "config.yaml",
        "--job",
        "43",
        "--set",
        "slurm.snapshot=false",
        cwd=folder,
    )
    assert off.returncode == 0 and off.stdout == ""


@pytest.mark.parametrize(
    "then, said",
    [
        ("missing.yaml", "--then missing.yaml: no such file"),
        ("broken.yaml", "--then broken.yaml: broken.yaml: not valid YAML"),
        ("nothing.yaml", "--then nothing.yaml: changes nothing in the first stage's config"),
        ("badkey.yaml", "--then badkey.yaml: badkey.yaml: unknown key 'optim.lrr'"),
    ],
)
def test_a_bad_stage_file_is_one_line_exit_2_naming_the_flag(tmp_path, then, said):
    folder = submit_dir(tmp_path)
    (folder / "broken.yaml").write_text("train: [\n")
    (folder / "nothing.yaml").write_text("train: {run_name: demo}\n")
    (folder / "badkey.yaml").write_text("optim: {lrr: 0.1}\n")
    env = {"PATH": str(Path(sys.executable).parent)}  # no sbatch: the checks come first
    result = cli("submit", "--config", "config.yaml", "--then", then, cwd=folder, env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert result.stderr.startswith(f"qgtrain: error: {said}"), result.stderr
    assert not (folder / "runs" / "demo").exists()


def test_stages_get_run_names_and_a_stage_from_an_export_never_written_is_refused(tmp_path):
    folder = submit_dir(tmp_path)
    first = load_config([folder / "config.yaml"], [f"logging.runs_dir={folder / 'runs'}"])
    export = folder / "runs" / "demo" / "export"
    (folder / "tune.yaml").write_text(f"model: {{pretrained: {export}}}\n")
    (folder / "named.yaml").write_text(
        "optim: {lr: 0.0001, min_lr: 0.00001}\ntrain: {run_name: last}\n"
    )
    with pytest.raises(
        ConfigError,
        match=r"--then .*tune.yaml: model.pretrained is stage 1's "
        r"export .* set export.on_finish: true for stage 1",
    ):
        stages.plan(first, [folder / "tune.yaml"])
    exporting = load_config(
        [folder / "config.yaml"], [f"logging.runs_dir={folder / 'runs'}", "export.on_finish=true"]
    )
    planned = stages.plan(exporting, [folder / "tune.yaml", folder / "named.yaml"])
    assert [s.cfg.train.run_name for s in planned] == ["demo", "demo-stage2", "last"]
    assert planned[1].cfg.model.pretrained == str(folder / "runs" / "demo" / "export")


def test_a_finished_stage_submits_the_next_exactly_once_and_a_failed_one_records_why(tmp_path):
    folder = submit_dir(tmp_path)
    env = stand_in_sbatch(tmp_path)
    (folder / "more.yaml").write_text("optim: {lr: 0.0001, min_lr: 0.00001}\n")
    (folder / "last.yaml").write_text("optim: {lr: 0.00001, min_lr: 0.000001}\n")
    submitted = cli(
        "submit",
        "--config",
        "config.yaml",
        "--then",
        "more.yaml",
        "--then",
        "last.yaml",
        cwd=folder,
        env=env,
    )
    assert submitted.returncode == 0, submitted.stderr
    chain = folder / "runs" / "demo" / "stages"
    assert submitted.stdout.startswith(
        "submitted stage 1 of 3 as job 101; each next stage is submitted when the one before "
        f"finishes; runs demo, demo-stage2, demo-stage3; chain in {chain}; code snapshot "
        f"{folder / 'runs' / 'demo' / 'code'}/"
    )
    first_status = folder / "runs" / "demo" / "status.json"
    first_status.write_text(json.dumps({"status": "preempted", "requeued": True}))
    said = cli("next-stage", str(chain), "--after", "1", "--exit-code", "75", cwd=folder, env=env)
    assert "stage 1 goes on after its requeue" in said.stderr
    assert not (chain / "2.submitted").exists()
    first_status.write_text(json.dumps({"status": "finished"}))
    for _ in range(2):  # a job that ran its epilogue twice (a requeue after it) submits once
        said = cli(
            "next-stage", str(chain), "--after", "1", "--exit-code", "0", cwd=folder, env=env
        )
    assert "stage 2 was submitted before" in said.stderr
    assert json.loads((chain / "2.submitted").read_text())["job_id"] == "102"
    second = (tmp_path / "sbatch.log").read_text().splitlines()[1]
    assert second == f"{folder} {chain / 'stage-2.sbatch'}", "from the submit directory"
    (folder / "runs" / "demo-stage2").mkdir()
    (folder / "runs" / "demo-stage2" / "status.json").write_text(
        json.dumps(
            {
                "status": "failed",
                "error": "task raised at step 1",
                "failures": [{"exit_code": 1, "action": "end"}],
            }
        )
    )
    said = cli("next-stage", str(chain), "--after", "2", "--exit-code", "1", cwd=folder, env=env)
    why = "stage 2 ended with exit 1 (failed: task raised at step 1)"
    assert f"stage 3 not submitted: {why}" in said.stderr
    assert len((tmp_path / "sbatch.log").read_text().splitlines()) == 2
    assert stages.describe(chain) == [
        "stage 1/3 demo: job 101: finished",
        "stage 2/3 demo-stage2: job 102: failed",
        f"stage 3/3 demo-stage3: not submitted: {why}",
    ]
    script = (chain / "stage-2.sbatch").read_text()
    assert f"qgtrain next-stage '{chain}' --after 2" in script
    code = folder / "runs" / "demo" / "code"
    assert f"\ncd {folder} || exit 1" in script and f"export PYTHONPATH={code}/" in script, (
        "the stage runs the snapshot's code in the submit folder"
    )
    last = (chain / "stage-3.sbatch").read_text()
    assert "next-stage" not in last, "the last stage submits nothing"


def test_submitit_jobs_and_sweeps_run_from_the_snapshot_too(tmp_path):
    folder = submit_dir(tmp_path)
    digest = codesnap.digest(codesnap.collect(folder, (folder / "runs", folder / "jobs" / "out")))
    shown = cli(
        "submit", "--launcher", "submitit", "--dry-run", "--config", "config.yaml", cwd=folder
    )
    setup = json.loads(shown.stdout)["slurm_setup"]
    code = f"{folder}/runs/demo/code/{digest}"
    first = f"export PYTHONPATH={code}/lib:{code}/submit" + '"${PYTHONPATH:+:$PYTHONPATH}"'
    assert f"{first}  # the code as submitted (slurm.snapshot)" in setup, setup
    assert "export PYTHONSAFEPATH=1  # the folder's modules never shadow the snapshot's" in setup
    assert any(line.startswith(f"cd {folder} || exit 1") for line in setup), setup
    swept = cli(
        "submit", "--dry-run", "--config", "config.yaml", "--sweep", "train.seed=1,2", cwd=folder
    )
    code = f"{folder}/runs/.sweeps/demo/code/{digest}"
    assert f"\nexport PYTHONPATH={code}/lib:{code}/submit" in swept.stdout, swept.stderr
    assert f"\ncd {folder} || exit 1" in swept.stdout
    assert not (folder / "runs" / ".sweeps").exists()


def test_a_chain_submitted_again_sets_the_earlier_one_aside_and_its_jobs_submit_nothing(tmp_path):
    folder = submit_dir(tmp_path)
    env = stand_in_sbatch(tmp_path)
    (folder / "more.yaml").write_text("optim: {lr: 0.0001, min_lr: 0.00001}\n")
    args = ["submit", "--config", "config.yaml", "--then", "more.yaml"]
    shown = cli(*args, "--dry-run", cwd=folder, env=env)
    handed = '--after 1 --exit-code "$status" --job "$claimed_by" --chain-id CHAIN-ID'
    assert handed in shown.stdout
    assert shown.stdout.endswith(
        "# stage 1: run demo from the first stage's config\n"
        "# stage 2: run demo-stage2 from more.yaml\n"
    )
    assert cli(*args, cwd=folder, env=env).returncode == 0
    chain = folder / "runs" / "demo" / "stages"
    old = json.loads((chain / "chain.json").read_text())["id"]
    assert cli(*args, cwd=folder, env=env).returncode == 0
    assert (chain / "earlier" / old / "1.submitted").is_file()
    (folder / "runs" / "demo" / "status.json").write_text(json.dumps({"status": "finished"}))
    said = cli(
        "next-stage",
        str(chain),
        "--after",
        "1",
        "--exit-code",
        "0",
        "--chain-id",
        old,
        cwd=folder,
        env=env,
    )
    assert f"this job's chain {old} was replaced by chain" in said.stderr
    assert not (chain / "2.submitted").exists()
    (chain / "2.submitted").write_text(json.dumps({"job_id": None, "claimed_by": "77"}))
    assert stages.describe(chain)[1] == (
        "stage 2/2 demo-stage2: claimed by job 77 but never confirmed (that job ended before "
        f"sbatch answered): see squeue, or submit it by hand: cd {folder} && sbatch "
        f"{chain / 'stage-2.sbatch'}"
    )
