"""The batch script and its submission, without a cluster. Runs against: the renderer, bash (the
rendered script is executed with stand-ins for srun and scontrol), shellcheck, and `qgtrain submit`
as a subprocess. The same script on a real cluster: test_slurm.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qgtrain.config import SlurmConfig
from qgtrain.config.load import load_config
from qgtrain.foundation.errors import QgtrainError
from qgtrain.launch.sbatch import parse_job_id, render
from qgtrain.launch.slurm_checks import time_minutes
from tests.helpers import cli, fresh_cli, stand_in_sbatch

ROOT = Path(__file__).resolve().parents[1]
SHELLCHECK = shutil.which("shellcheck") or str(Path(sys.executable).parent / "shellcheck")


def shellcheck(path: Path) -> None:
    result = subprocess.run([SHELLCHECK, str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_train_slurm_is_the_script_rendered_from_the_default_config():
    assert (ROOT / "train.slurm").read_text() == render(
        load_config([ROOT / "config.yaml"]).slurm, "config.yaml"
    )


def test_train_slurm_passes_bash_n_and_shellcheck():
    subprocess.run(["bash", "-n", str(ROOT / "train.slurm")], check=True)
    shellcheck(ROOT / "train.slurm")


def test_the_header_asks_for_what_requeue_and_preemption_need():
    script = (ROOT / "train.slurm").read_text()
    for line in (
        "#SBATCH --requeue",
        "#SBATCH --signal=USR2@120",
        "#SBATCH --open-mode=append",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --output=jobs/out/%x-%j.out",
    ):
        assert line in script
    assert 'run_steps --kill-on-bad-exit=1 "$PYTHON" -m qgtrain train' in script
    assert "SLURM_PROCID" not in script and "MASTER_" not in script, (
        "no rank or address logic in bash"
    )


@pytest.mark.parametrize("overlay", sorted((ROOT / "jobs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_job_overlay_loads_and_renders_a_clean_script(tmp_path, overlay):
    cfg = load_config([ROOT / "config.yaml", overlay])
    script = tmp_path / "job.sbatch"
    script.write_text(render(cfg.slurm, "config.yaml"))
    subprocess.run(["bash", "-n", str(script)], check=True)
    shellcheck(script)


def test_gpu_overlay_asks_for_one_task_per_gpu():
    cfg = load_config([ROOT / "config.yaml", ROOT / "jobs" / "gpu-multinode.yaml"])
    script = render(cfg.slurm, "config.yaml")
    assert "#SBATCH --nodes=2\n" in script and "#SBATCH --ntasks-per-node=4\n" in script
    assert "#SBATCH --gpus-per-node=4\n" in script and "#SBATCH --mem=256G\n" in script


def test_submitit_job_script_dry_run_prints_the_same_resources():
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "jobs" / "submitit_job.py"),
            "--dry-run",
            "--config",
            str(ROOT / "config.yaml"),
            "--set",
            "slurm.nodes=2",
            "slurm.gpus_per_node=4",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    params = json.loads(result.stdout)
    assert (
        params["nodes"],
        params["tasks_per_node"],
        params["gpus_per_node"],
        params["timeout_min"],
    ) == (2, 4, 4, 60)
    assert "export SUBMITIT_PREEMPT_SIGNAL=USR2" in params["slurm_setup"]


NASTY = (
    "x$(touch {m}/dollar)`touch {m}/tick`;touch {m}/semi|touch {m}/pipe&&touch {m}/and'\"\n"
    "#SBATCH --x"
)


@pytest.mark.parametrize(
    "key",
    [
        "job_name",
        "partition",
        "account",
        "qos",
        "constraint",
        "mem",
        "output_dir",
        "time",
        "container_image",
        "apptainer_image",
    ],
)
def test_slurm_values_that_could_break_out_are_refused_naming_the_key(tmp_path, key):
    with pytest.raises(QgtrainError, match=rf"slurm.{key}: "):
        render(SlurmConfig(**{key: NASTY.format(m=tmp_path)}), "config.yaml")


def test_extra_sbatch_lines_must_be_options():
    with pytest.raises(QgtrainError, match="slurm.extra_sbatch"):
        render(SlurmConfig(extra_sbatch=("--exclusive\nrm -rf /",)), "config.yaml")
    assert "#SBATCH --reservation=big\n" in render(
        SlurmConfig(extra_sbatch=("--reservation=big",)), "c.yaml"
    )


def test_a_config_with_shell_metacharacters_everywhere_runs_no_injected_command(tmp_path):
    """Every string field gets a nasty value; the ones the script uses are quoted (the run
    directory, and so the config path) or refused above. The script is executed with stand-ins for
    srun and scontrol."""
    marks = tmp_path / "marks"
    marks.mkdir()
    nasty = NASTY.format(m=marks).replace("\n#SBATCH --x", "")
    strings = {
        "model.arch": nasty,
        "data.corpus": nasty,
        "data.tokenizer": nasty,
        "data.cache_dir": nasty,
        "logging.runs_dir": str(tmp_path / "runs dir") + nasty.replace("/", "_"),
        "export.dir": nasty,
        "checkpoint.resume": nasty,
    }
    cfg = load_config([ROOT / "config.yaml"], [f"{k}={v}" for k, v in strings.items()])
    run_dir = Path(cfg.logging.runs_dir) / cfg.train.run_name
    config_path = str(run_dir / "slurm" / "config.yaml")
    script = tmp_path / "job.sbatch"
    script.write_text(render(cfg.slurm, config_path))
    subprocess.run(["bash", "-n", str(script)], check=True)
    env = {**recording_srun_and_scontrol(tmp_path, 76), "QGTRAIN_PYTHON": "python3"}
    before = set(tmp_path.rglob("*"))
    result = subprocess.run(
        ["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert result.returncode == 76, result.stderr
    created = set(tmp_path.rglob("*")) - before - {tmp_path / "srun.txt", tmp_path / "scontrol.txt"}
    assert created == set(), f"an injected command ran: {created}"
    assert (tmp_path / "srun.txt").read_text().splitlines() == [
        "--kill-on-bad-exit=1",
        "python3",
        "-m",
        "qgtrain",
        "train",
        "--config",
        config_path,
    ]
    assert (tmp_path / "scontrol.txt").read_text() == "requeue\n77\n", (
        "exit 76 makes the batch shell requeue"
    )


def test_several_config_files_become_several_config_options(tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render(SlurmConfig(), "config.yaml"))
    (tmp_path / "srun").write_text('#!/bin/bash\nprintf "%s\\n" "$@" > args.txt\n')
    (tmp_path / "srun").chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", "QGTRAIN_PYTHON": "py"}
    subprocess.run(
        ["bash", str(script), "config.yaml", "jobs/cpu.yaml"], cwd=tmp_path, env=env, check=True
    )
    assert (tmp_path / "args.txt").read_text().split() == [
        "--kill-on-bad-exit=1",
        "py",
        "-m",
        "qgtrain",
        "train",
        "--config",
        "config.yaml",
        "--config",
        "jobs/cpu.yaml",
    ]


@pytest.mark.parametrize(
    "text, minutes",
    [
        ("90", 90),
        ("1:30", 2),
        ("01:00:00", 60),
        ("2-00", 2880),
        ("1-02:03", 1563),
        ("0-00:00:30", 1),
    ],
)
def test_slurm_time_formats(text, minutes):
    assert time_minutes(text) == minutes


def test_job_ids_are_parsed_from_sbatch_output():
    assert parse_job_id("123\n") == "123"
    assert parse_job_id("456;cluster\n") == "456"
    assert parse_job_id("Submitted batch job 789\n") == "789"


def test_submit_dry_run_prints_the_script_without_importing_torch_or_submitit(tmp_path):
    code = (
        "import sys; from qgtrain.interface.cli import main; rc = main(['submit', '--dry-run', "
        f"'--config', {str(ROOT / 'config.yaml')!r}]); print(rc, [m for m in ('torch', "
        "'transformers', 'submitit') if m in sys.modules], file=sys.stderr)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path
    )
    assert result.stderr.strip() == "0 []"
    assert result.stdout.startswith("#!/bin/bash") and "#SBATCH --requeue" in result.stdout


def user_folder(tmp_path: Path) -> Path:
    """A user's own folder, outside the repository: a task module, a config, a data file."""
    folder = tmp_path / "project"
    (folder / "data").mkdir(parents=True)
    (folder / "my_task.py").write_text("VALUE = 'as submitted'\n")
    (folder / "data" / "events.txt").write_text("42\n")
    (folder / "config.yaml").write_text("train: {run_name: demo}\nlogging: {runs_dir: runs}\n")
    (folder / "more.yaml").write_text("optim: {lr: 0.0001, min_lr: 0.00001}\n")
    return folder


@pytest.mark.parametrize(
    "command",
    [
        ["qgtrain", "submit"],
        ["qgtrain", "submit", "--launcher", "submitit"],
        ["qgtrain", "submit", "--sweep", "train.seed=1,2"],
        ["qgtrain", "submit", "--sweep", "train.seed=1,2", "--launcher", "submitit"],
        ["qgtrain", "submit", "--then", "more.yaml"],
        ["python", str(ROOT / "jobs" / "submitit_job.py")],
    ],
    ids=["sbatch", "submitit", "sweep", "submitit-sweep", "stages", "submitit_job.py"],
)
def test_submit_without_slurm_is_one_line_exit_2_and_writes_nothing(tmp_path, command):
    """Run as a user runs it from their folder: the venv's own scripts by path, nothing activated,
    and a PATH without sbatch (nor srun)."""
    folder = user_folder(tmp_path)
    bin_dir = Path(sys.executable).parent
    program = [str(bin_dir / "qgtrain")] if command[0] == "qgtrain" else [sys.executable]
    before = sorted(tmp_path.rglob("*"))
    result = subprocess.run(
        [*program, *command[1:], "--config", "config.yaml"],
        capture_output=True,
        text=True,
        cwd=folder,
        env={**os.environ, "PATH": str(tmp_path / "no-slurm")},
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr == (
        "qgtrain: error: submit: no Slurm here (sbatch is not on PATH); nothing was submitted or "
        "written. HINT: run `qgtrain train` to train here, or submit from a login node\n"
    )
    assert sorted(tmp_path.rglob("*")) == before, "no snapshot, run folder, submitit/ or jobs/out"


SUBMITTER = "/opt/my env/bin/python"  # a venv's interpreter, with a space in its path


@pytest.mark.parametrize(
    "slurm, python, env, venv_here, expected",
    [
        (SlurmConfig(), SUBMITTER, {}, False, SUBMITTER),
        (SlurmConfig(), SUBMITTER, {}, True, SUBMITTER),
        (SlurmConfig(), SUBMITTER, {"QGTRAIN_PYTHON": "/site/py"}, True, "/site/py"),
        (SlurmConfig(), None, {}, False, "python3"),
        (SlurmConfig(), None, {}, True, "{pwd}/.venv/bin/python"),
        (SlurmConfig(), None, {"QGTRAIN_PYTHON": "/site/py"}, True, "/site/py"),
        (SlurmConfig(container_image="img"), SUBMITTER, {}, True, "python"),
    ],
    ids=[
        "submitter",
        "submitter-over-a-venv-here",
        "QGTRAIN_PYTHON-wins",
        "train.slurm-node-python3",
        "train.slurm-venv-here",
        "train.slurm-QGTRAIN_PYTHON",
        "container-image-python",
    ],
)
def test_the_job_runs_the_interpreter_that_submitted_it_unless_qgtrain_python_names_one(
    tmp_path, slurm, python, env, venv_here, expected
):
    """The rendered script executed by bash, srun a stand-in that records what it was asked to run:
    the Python before `-m qgtrain`."""
    if venv_here:
        (tmp_path / ".venv" / "bin").mkdir(parents=True)
        (tmp_path / ".venv" / "bin" / "python").write_text("#!/bin/sh\n")
        (tmp_path / ".venv" / "bin" / "python").chmod(0o755)
    script = render(slurm, "config.yaml", python=python)
    (tmp_path / "rendered.sbatch").write_text(script)
    shellcheck(tmp_path / "rendered.sbatch")
    code, args, _ = run_script(script, tmp_path, more_env=env)
    assert code == 0 and args[args.index("-m") - 1] == expected.format(pwd=tmp_path), args


def test_submit_renders_its_own_interpreter_as_a_path_not_resolved_through_links(tmp_path):
    """A venv's python is a link to the base interpreter; only the link's place makes it the venv's
    (and its torch), so the script names the link."""
    shown = cli("submit", "--dry-run", "--config", str(ROOT / "config.yaml"), cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    itself = os.path.abspath(sys.executable)
    line = f"PYTHON=${{QGTRAIN_PYTHON:-{itself}}}  # the interpreter that submitted the job\n"
    assert line in shown.stdout and "[ -x .venv/bin/python ]" not in shown.stdout
    resolved = os.path.realpath(sys.executable)
    assert resolved == itself or resolved not in shown.stdout


PROBE = (
    "import os, my_task, qgtrain\n"
    "package = os.path.dirname(os.path.dirname(qgtrain.__file__))\n"
    "print(os.getcwd(), my_task.VALUE, package, sep='\\n')\n"
    "print(open('data/events.txt').read().strip() if os.path.exists('data/events.txt') else '-')"
)


@pytest.mark.parametrize("safe_path", [True, False], ids=["python-3.11+", "python-3.10"])
def test_a_submitted_job_runs_in_its_submit_folder_with_the_snapshots_code_first(
    tmp_path, safe_path
):
    """`qgtrain submit` (sbatch a stand-in), then the job script executed by bash from elsewhere,
    its srun a stand-in that runs the step's Python on a probe: where it runs, which my_task and
    qgtrain it imports (the live my_task edited after submit), and whether the task's relative data
    path finds the file. A Python without PYTHONSAFEPATH (a wrapper failing that check) runs in the
    snapshot's copy instead, and says so."""
    folder = user_folder(tmp_path)
    submitted = cli("submit", "--config", "config.yaml", cwd=folder, env=stand_in_sbatch(tmp_path))
    assert submitted.returncode == 0, submitted.stderr
    (folder / "my_task.py").write_text("VALUE = 'edited after submit'\n")
    (code,) = (folder / "runs" / "demo" / "code").glob("????????????????")
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    (nodes / "srun").write_text('#!/bin/bash\nshift\necho "$1"\n"$1" -c "$PROBE"\n')
    old_python = nodes / "python3.10"
    old_python.write_text(
        f'#!/bin/bash\n[[ "$*" == *safe_path* ]] && exit 1\nexec {sys.executable} "$@"\n'
    )
    for made in (nodes / "srun", old_python):
        made.chmod(0o755)
    env = {"PATH": f"{nodes}:/usr/bin:/bin", "SLURM_JOB_ID": "77", "PROBE": PROBE}
    done = subprocess.run(
        ["bash", str(folder / "runs" / "demo" / "slurm" / "job.sbatch")],
        cwd=tmp_path,
        env=env if safe_path else {**env, "QGTRAIN_PYTHON": str(old_python)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    python, cwd, value, package_from, data = done.stdout.split("\n")[:5]
    assert python == (os.path.abspath(sys.executable) if safe_path else str(old_python))
    assert value == "as submitted" and package_from == str(code / "lib")
    if safe_path:
        assert (cwd, data) == (str(folder), "42") and "sys.path" not in done.stderr
    else:
        assert (cwd, data) == (str(code / "submit"), "-"), "data/ is not code"
        assert "this Python puts" in done.stderr


def test_a_sweep_renders_one_job_array_whose_tasks_train_their_own_configs(tmp_path):
    result = cli(
        "submit",
        "--dry-run",
        "--config",
        str(ROOT / "config.yaml"),
        "--sweep",
        "optim.lr=1e-3,3e-4",
        "--sweep",
        "train.seed=1,2",
        "--max-parallel",
        "2",
        "--set",
        f"logging.runs_dir={tmp_path}",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    script = result.stdout
    assert "#SBATCH --array=0-3%2" in script and "#SBATCH --output=jobs/out/%x-%A_%a.out" in script
    assert (
        f'default_config={tmp_path}/.sweeps/tiny-gpt2/task-"${{SLURM_ARRAY_TASK_ID}}".yaml'
        in script
    )
    tasks = [line for line in script.splitlines() if line.startswith("# task ")]
    assert tasks == [
        "# task 0: tiny-gpt2-lr_1e-3-seed_1: optim.lr=1e-3 train.seed=1",
        "# task 1: tiny-gpt2-lr_1e-3-seed_2: optim.lr=1e-3 train.seed=2",
        "# task 2: tiny-gpt2-lr_3e-4-seed_1: optim.lr=3e-4 train.seed=1",
        "# task 3: tiny-gpt2-lr_3e-4-seed_2: optim.lr=3e-4 train.seed=2",
    ]
    (tmp_path / "array.sbatch").write_text(script)
    shellcheck(tmp_path / "array.sbatch")
    assert not (tmp_path / ".sweeps").exists(), "a dry run writes nothing"


@pytest.mark.parametrize(
    "sweeps, expected",
    [
        (
            ["optim.lrr=1e-3,3e-4"],
            r"--sweep optim.lrr=1e-3: .*unknown key 'optim.lrr'. Did you mean 'optim.lr'",
        ),
        (["train.seed=1,two"], r"--sweep train.seed=two: .*train.seed: expected an integer"),
        (["optim.lr="], r"--sweep 'optim.lr=': expected KEY=VALUE\[,VALUE...\]"),
        (["optim.lr=1e-3", "optim.lr=3e-4"], r"--sweep optim.lr: given twice"),
        (
            ["train.seed=" + ",".join(map(str, range(1002)))],
            r"1002 combinations, but this cluster's MaxArraySize "
            r"allows 1001 tasks",
        ),
    ],
)
def test_a_bad_sweep_is_one_line_exit_2_and_nothing_submitted(tmp_path, sweeps, expected):
    import re

    args = [arg for sweep in sweeps for arg in ("--sweep", sweep)]
    env_path = str(Path(sys.executable).parent)  # no scontrol, no sbatch: the checks come first
    result = fresh_cli(
        "submit",
        "--config",
        str(ROOT / "config.yaml"),
        *args,
        "--set",
        f"logging.runs_dir={tmp_path}",
        cwd=tmp_path,
        env={**os.environ, "PATH": env_path, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert re.search(expected, result.stderr), result.stderr
    assert not (tmp_path / ".sweeps").exists()


def recording_srun_and_scontrol(
    tmp_path: Path, srun_exit: int, *more: tuple[str, str]
) -> dict[str, str]:
    """An env whose srun (exit `srun_exit`) and scontrol write their arguments to tmp_path."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool, body in (
        ("srun", f'printf "%s\\n" "$@" > "$SRUN_ARGS"; exit {srun_exit}'),
        ("scontrol", 'printf "%s\\n" "$@" > "$SCONTROL_ARGS"'),
        *more,
    ):
        (bin_dir / tool).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / tool).chmod(0o755)
    return {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "SRUN_ARGS": str(tmp_path / "srun.txt"),
        "SCONTROL_ARGS": str(tmp_path / "scontrol.txt"),
        "SLURM_JOB_ID": "77",
    }


def run_script(
    script: str, tmp_path: Path, srun_exit: int = 0, more_env: dict[str, str] | None = None
) -> tuple[int, list[str], str]:
    """Execute a rendered script with stand-ins for srun (records its arguments) and scontrol; no
    QGTRAIN_PYTHON unless `more_env` sets it, so the script picks its interpreter itself."""
    (tmp_path / "job.sbatch").write_text(script)
    host_python = ("host-python", 'printf "%s\\n" "$@" > "$HOST_ARGS"; echo end')
    env = {
        **recording_srun_and_scontrol(tmp_path, srun_exit, host_python),
        "HOST_ARGS": str(tmp_path / "host"),
        "QGTRAIN_HOST_PYTHON": str(tmp_path / "bin" / "host-python"),
        **(more_env or {}),
    }
    done = subprocess.run(
        ["bash", str(tmp_path / "job.sbatch")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    requeued = (
        (tmp_path / "scontrol.txt").read_text() if (tmp_path / "scontrol.txt").exists() else ""
    )
    return done.returncode, (tmp_path / "srun.txt").read_text().splitlines(), requeued


TRAIN = ["python", "-m", "qgtrain", "train", "--config", "config.yaml"]


@pytest.mark.parametrize(
    "slurm, srun",
    [
        (
            SlurmConfig(
                container_image="nvcr.io#nvidia/pytorch:24.08-py3",
                container_mounts=("/data:/data", "/s:/s:ro"),
                gpus_per_node=4,
            ),
            [
                "--container-image=nvcr.io#nvidia/pytorch:24.08-py3",
                "--container-mounts={pwd}:{pwd},/data:/data,/s:/s:ro",
                "--container-workdir={pwd}",
                *TRAIN,
            ],
        ),
        (
            SlurmConfig(container_image="/shared/images/pytorch.sqsh"),
            [
                "--container-image=/shared/images/pytorch.sqsh",
                "--container-mounts={pwd}:{pwd}",
                "--container-workdir={pwd}",
                *TRAIN,
            ],
        ),
        (
            SlurmConfig(
                apptainer_image="/shared/images/pytorch.sif",
                container_mounts=("/data:/data",),
                gpus_per_node=4,
            ),
            [
                "apptainer",
                "exec",
                "--nv",
                "--pwd",
                "{pwd}",
                "--bind",
                "/data:/data",
                "/shared/images/pytorch.sif",
                *TRAIN,
            ],
        ),
        (
            SlurmConfig(apptainer_image="docker://nvcr.io/nvidia/pytorch:24.08-py3"),
            [
                "apptainer",
                "exec",
                "--pwd",
                "{pwd}",
                "docker://nvcr.io/nvidia/pytorch:24.08-py3",
                *TRAIN,
            ],
        ),
    ],
    ids=["pyxis-gpu", "pyxis-sqsh", "apptainer-gpu", "apptainer-cpu"],
)
def test_a_container_job_starts_every_task_in_the_image_and_still_requeues_from_the_batch_shell(
    tmp_path, slurm, srun
):
    script = render(slurm, "config.yaml")
    (tmp_path / "rendered.sbatch").write_text(script)
    subprocess.run(["bash", "-n", str(tmp_path / "rendered.sbatch")], check=True)
    shellcheck(tmp_path / "rendered.sbatch")
    code, args, requeued = run_script(script, tmp_path)
    assert code == 0 and args == ["--kill-on-bad-exit=1", *(a.format(pwd=tmp_path) for a in srun)]
    assert requeued == ""
    code, _, requeued = run_script(script, tmp_path, srun_exit=76)  # no scontrol inside the image
    assert code == 76 and requeued == "requeue\n77\n"
    # a failed step is judged outside the image
    code, _, _ = run_script(script, tmp_path, srun_exit=1)
    assert code == 1 and (tmp_path / "host").read_text().split()[:5] == [
        "-m",
        "qgtrain",
        "recover",
        "--config",
        "config.yaml",
    ]


@pytest.mark.parametrize(
    "sets, key",
    [
        (
            ["slurm.container_image=img;touch x"],
            "slurm.container_image: 'img;touch x' is not allowed",
        ),
        (
            ["slurm.apptainer_image=$(touch x).sif"],
            "slurm.apptainer_image: '$(touch x).sif' is not allowed",
        ),
        (
            ["slurm.container_image=a", "slurm.container_mounts=['/a:/b,/c:/d']"],
            "slurm.container_mounts: '/a:/b,/c:/d'",
        ),
        (
            ["slurm.container_image=a", "slurm.container_mounts=['/a:/b\" x']"],
            "slurm.container_mounts: ",
        ),
        (
            ["slurm.container_image=a", "slurm.apptainer_image=b"],
            "slurm.apptainer_image: set together with",
        ),
        (
            ["slurm.container_mounts=['/a:/a']"],
            "slurm.container_mounts: there is no container to mount into",
        ),
    ],
)
@pytest.mark.parametrize("launcher", ["sbatch", "submitit"])
def test_a_bad_container_value_is_one_line_exit_2_naming_the_key(tmp_path, sets, key, launcher):
    result = cli(
        "submit",
        "--dry-run",
        "--launcher",
        launcher,
        "--config",
        str(ROOT / "config.yaml"),
        "--set",
        *sets,
        cwd=tmp_path,
    )
    assert result.returncode == 2 and result.stdout == "", result.stdout
    assert result.stderr.startswith(f"qgtrain: error: {key}") and result.stderr.count("\n") == 1, (
        result.stderr
    )
    assert not (tmp_path / "x").exists()


def test_submitit_starts_the_tasks_in_the_same_container(tmp_path):
    from qgtrain.launch.submitit_params import container_python, executor_parameters

    pyxis = load_config(
        [ROOT / "config.yaml"],
        [
            "slurm.container_image=nvcr.io#nvidia/pytorch:24.08-py3",
            "slurm.container_mounts=['/data:/data']",
        ],
    )
    assert executor_parameters(pyxis, "/work/me")["slurm_srun_args"] == [
        "--kill-on-bad-exit=1",
        "--container-image=nvcr.io#nvidia/pytorch:24.08-py3",
        "--container-mounts=/work/me:/work/me,/data:/data",
        "--container-workdir=/work/me",
    ]
    assert container_python(pyxis) == "python"
    apptainer = load_config(
        [ROOT / "config.yaml"],
        [
            "slurm.apptainer_image=/img/pt.sif",
            "slurm.gpus_per_node=2",
            "slurm.container_mounts=['/data:/data']",
        ],
    )
    assert (
        container_python(apptainer, "/work/me")
        == "apptainer exec --nv --pwd /work/me --bind /data:/data "
        "/img/pt.sif python"
    )
    assert executor_parameters(apptainer)["slurm_srun_args"] == ["--kill-on-bad-exit=1"]
    host = load_config([ROOT / "config.yaml"])
    assert container_python(host) is None
    assert executor_parameters(host)["slurm_srun_args"] == ["--kill-on-bad-exit=1"]
    shown = json.loads(
        cli(
            "submit",
            "--dry-run",
            "--launcher",
            "submitit",
            "--config",
            str(ROOT / "config.yaml"),
            "--config",
            str(ROOT / "jobs" / "container.yaml"),
            cwd=tmp_path,
        ).stdout
    )
    assert shown["slurm_srun_args"][1] == "--container-image=nvcr.io#nvidia/pytorch:24.08-py3"
    assert shown["slurm_python"] == "python"


def run_with_stand_in_srun(tmp_path: Path, script: str, config: str, failures: list[str]) -> Path:
    """Run a rendered batch script with a stand-in srun whose first steps fail, each with one of
    `failures` (what srun writes to stderr; exit 137), and the next one finishes; the real
    `qgtrain recover` answers between them. Returns the file where each step's srun arguments
    are, a line a step (outside the folder, which the job snapshots)."""
    (tmp_path / "config.yaml").write_text(config)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    cases = "".join(
        f'    {n}) echo "{said}" >&2; exit 137 ;;\n' for n, said in enumerate(failures, start=1)
    )
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        'printf "%s " "$@" >> "$SRUN_ARGS"; echo >> "$SRUN_ARGS"\n'
        f'case $(wc -l < "$SRUN_ARGS") in\n{cases}esac\n'
    )
    (bin_dir / "srun").chmod(0o755)
    (tmp_path / "job.sbatch").write_text(script)
    said = tmp_path.parent / f"{tmp_path.name}-srun.txt"
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHONPATH": str(ROOT),
        "SRUN_ARGS": str(said),
        "SLURM_JOB_ID": "77",
    }
    done = subprocess.run(
        ["bash", "job.sbatch"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return said


def test_a_step_that_fails_on_a_node_runs_again_on_a_spare_without_that_node(tmp_path):
    """slurm.spare_nodes: the job asks for the spare and keeps its allocation when a node fails
    (--no-kill); each step asks for slurm.nodes of it. A rank killed on node2, then one on node3:
    the first retry leaves node2 out (on the spare); the second finds no spare left, so it is an
    ordinary retry and node2 stays out."""
    slurm = SlurmConfig(nodes=2, spare_nodes=1, tasks_per_node=2)
    script = render(slurm, "config.yaml", python=sys.executable)
    for line in ("#SBATCH --nodes=3", "#SBATCH --ntasks-per-node=2", "#SBATCH --no-kill"):
        assert line in script.splitlines()
    said = run_with_stand_in_srun(
        tmp_path,
        script,
        f"logging: {{runs_dir: '{tmp_path / 'runs'}'}}\ntrain: {{run_name: spare}}\n",
        ["srun: error: node2: task 2: Killed", "srun: error: node3: task 0: Killed"],
    )
    steps = [line.split() for line in said.read_text().splitlines()]
    step = ["--nodes=2", "--ntasks=4", "--kill-on-bad-exit=1"]
    assert [s[:4] for s in steps] == [
        step + [sys.executable],
        ["--exclude=node2", *step],
        ["--exclude=node2", *step],
    ]
    failures = json.loads((tmp_path / "runs" / "spare" / "status.json").read_text())["failures"]
    assert [f["action"] for f in failures] == ["retry node2", "retry"]
    assert "on a spare node, without node2 (0 spare(s) left)" in failures[0]["reason"]
    assert failures[1]["reason"] == "retry 2 of 2 in this allocation"


def test_a_submitit_job_with_a_spare_node_asks_for_it_and_runs_each_step_on_the_others():
    from qgtrain.launch.submitit_params import executor_parameters

    cfg = load_config([ROOT / "config.yaml"], ["slurm.nodes=2", "slurm.spare_nodes=1"])
    params = executor_parameters(cfg, recover_args="--run-dir /r")
    assert params["nodes"] == 3 and params["slurm_additional_parameters"]["no_kill"] is True
    assert params["slurm_srun_args"] == ["--kill-on-bad-exit=1"]
    setup = "\n".join(params["slurm_setup"])
    assert '--nodes="$nodes" --ntasks=$((nodes * per_node))' in setup
    assert "local nodes=2 per_node=1" in setup and "--spare-nodes 1 --away" in setup
    assert 'srun() { run_steps "$@"; }' in setup


def test_with_no_spare_left_a_step_that_fails_on_a_node_runs_again_on_fewer_nodes(tmp_path):
    """slurm.min_nodes: the job keeps its allocation when a node fails (--no-kill). A rank killed
    on node2, then node3 lost: three nodes with two micro-batches each make six a step, so the
    first retry runs on the two nodes left, the second on one, each without the nodes that
    failed; a requeued job starts on slurm.nodes again."""
    slurm = SlurmConfig(nodes=3, min_nodes=1, tasks_per_node=2)
    script = render(slurm, "config.yaml", python=sys.executable)
    assert "#SBATCH --nodes=3" in script.splitlines() and "#SBATCH --no-kill" in script
    config = (
        f"logging: {{runs_dir: '{tmp_path / 'runs'}'}}\ntrain: {{run_name: fewer, "
        "grad_accum_steps: 2}\nslurm: {nodes: 3, min_nodes: 1, tasks_per_node: 2}\n"
    )
    lost = ["srun: error: node2: task 2: Killed", "srun: error: Node failure on node3"]
    said = run_with_stand_in_srun(tmp_path, script, config, lost)
    steps = [line.split() for line in said.read_text().splitlines()]
    assert [s[:3] for s in steps] == [
        ["--nodes=3", "--ntasks=6", "--kill-on-bad-exit=1"],
        ["--exclude=node2", "--nodes=2", "--ntasks=4"],
        ["--exclude=node2,node3", "--nodes=1", "--ntasks=2"],
    ]
    failures = json.loads((tmp_path / "runs" / "fewer" / "status.json").read_text())["failures"]
    assert [f["action"] for f in failures] == ["retry node2 2", "retry node3 1"]
    first = failures[0]["reason"]
    assert "no spare node left: retrying in this allocation on 2 node(s), without node2, " in first
    assert failures[1]["reason"].startswith("srun: Node failure on node3; no spare node left")
    # a requeued job runs the script again (the stand-in's failures used up), on slurm.nodes
    said.write_text("\n" * 3)
    run_with_stand_in_srun(tmp_path, script, config, lost)
    last = said.read_text().splitlines()[-1].split()
    assert last[:3] == ["--nodes=3", "--ntasks=6", "--kill-on-bad-exit=1"]
