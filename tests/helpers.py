"""What many tests need, written once: a small config, running the CLI, reading a run's metrics,
logs and checkpoints, waiting for a run to get somewhere, and submitting to and waiting on the Slurm
test cluster."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from qgtrain.config import DataConfig
from qgtrain.state import checkpoint
from tests.ranks import ROOT, ForkedCommand, kill_ranks, needs_fresh_interpreter

FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
# Two nodes of the test cluster, one rank each; the first two, so a test that cuts node2 cuts this
# job.
TWO_NODES = ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--nodelist=node[1-2]")


# A run that costs almost nothing: synthetic tokens, a one-layer model of tests/factories.py, no
# TensorBoard. A constant learning rate: tests raise train.max_steps on resume, which would move a
# cosine (refused).
TINY = [
    "data.name=synthetic",
    "data.seq_len=16",
    "train.batch_size=4",
    "train.log_every=1",
    "logging.tensorboard=false",
    "model.factory=tests.factories:tiny",
    "optim.warmup_steps=0",
    "optim.schedule=constant",
]


def tiny_config(*sets: str) -> Any:
    """The TINY settings with `sets` on top, as a RunConfig (the built-in defaults beneath)."""
    from qgtrain.config.load import load_config

    return load_config([], [*TINY, *sets])


def train_command(run: Path, *sets: str) -> list[str]:
    """`qgtrain train --run-dir RUN --set SETS...`: how most tests start a run, written once."""
    return ["train", "--run-dir", str(run), "--set", *sets]


def cli(
    *args: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    timeout: float = 300,
    launcher: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """`python -m qgtrain ARGS` (or under `launcher`, e.g. torchrun) as a user runs it, in `cwd`,
    with this repository importable (tests.tasks, tests.factories) like a user's own modules. The
    process is forked from the tests' preloaded forkserver (tests.ranks.ForkedCommand) unless a
    launcher or `env` needs a fresh interpreter."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    if launcher or needs_fresh_interpreter(full_env):
        command = [*launcher] if launcher else [sys.executable, "-m", "qgtrain"]
        return subprocess.run(
            [*command, *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
        )
    with tempfile.TemporaryDirectory(prefix="qgtrain-cli-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        proc = ForkedCommand(list(args), cwd, full_env, out, err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            raise
        return subprocess.CompletedProcess(
            [sys.executable, "-m", "qgtrain", *args],
            code,
            out.read_text(errors="replace"),
            err.read_text(errors="replace"),
        )


def fresh_cli(
    *args: str, cwd: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`python -m qgtrain ARGS` in a new interpreter (env: this one's unless given), not forked."""
    return subprocess.run(
        [sys.executable, "-m", "qgtrain", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def wait_for(  # type: ignore[no-untyped-def]
    condition, procs, what: str, timeout: float = 180, pause: float = 0.002
) -> None:
    """The one polling loop of the tests: poll `condition` until it holds; fail at once if one of
    `procs` (subprocess.Popen or multiprocessing.Process) exits first, or after `timeout` seconds,
    killing them."""
    deadline = time.monotonic() + timeout
    while not condition():
        if not all(map(_alive, procs)):
            codes = [p.poll() if hasattr(p, "poll") else p.exitcode for p in procs]
            raise AssertionError(f"a process exited ({codes}) before {what}")
        if time.monotonic() > deadline:
            for proc in procs:
                _kill(proc)
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(pause)


def kill_once_saved(run: Path, procs: list[Any], step: int, timeout: float = 180) -> None:
    """SIGKILL the ranks of `run` once it has logged `step` and committed a checkpoint. A save's
    commit may trail the step it saved (an async save writes beside the next steps), and a kill
    before the first commit makes the next launch start over: a resume test would then compare a
    fresh run with its reference and pass without resuming anything."""
    wait_for(
        lambda: (
            any(r["step"] >= step for r in records(run)[-1:])
            and bool(checkpoint.list_committed(run / "checkpoints"))
        ),
        procs,
        f"step {step} and a committed checkpoint",
        timeout,
    )
    kill_ranks(procs)


def _alive(proc: Any) -> bool:
    return proc.poll() is None if hasattr(proc, "poll") else bool(proc.is_alive())


def _kill(proc: Any) -> None:
    if not hasattr(proc, "poll"):
        proc.kill()
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def lines_in(path: Path) -> int:
    """Lines written so far (0 before the file exists): a run's progress in metrics.jsonl."""
    return path.read_text().count("\n") if path.exists() else 0


def checkpoint_digests(run: Path) -> dict[str, str]:
    """Every file under a run's checkpoints/ by its SHA-256: what a refused resume must leave."""
    return {
        str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in (run / "checkpoints").rglob("*")
        if p.is_file()
    }


def checkpoint_state(folder: Path) -> dict[str, torch.Tensor]:
    """A committed checkpoint's model and optimizer tensors, flat (`model.<name>`,
    `optim.<param>.<key>`, and `ema.<name>` where it holds an EMA of the weights), of either kind:
    rank 0's model.pt, optim.pt and ema.pt, or every rank's shards (read whole through DCP)."""
    if (folder / "sharded").exists():
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        whole = folder.parent / f"{folder.name}-whole.pt"
        dcp_to_torch_save(folder / "sharded", whole)
        saved = torch.load(whole, weights_only=False)
        model, optim, ema = saved["model"], saved["optim"]["state"], saved.get("ema", {})
    else:
        model = torch.load(folder / "model.pt", weights_only=True)
        optim = torch.load(folder / "optim.pt", weights_only=True)["optimizer"]["state"]
        ema = (
            torch.load(folder / "ema.pt", weights_only=True) if (folder / "ema.pt").exists() else {}
        )
    flat = {f"model.{k}": v for k, v in model.items()}
    flat.update({f"ema.{k}": v for k, v in ema.items()})
    for param, state in optim.items():
        flat.update({f"optim.{param}.{k}": v for k, v in state.items()})
    return flat


# The ready examples of jobs/ on settings a test can afford (test_examples.py, test_molecules.py).
EXAMPLE_STEPS = 24
EXAMPLES = {
    "graph": ["task.options={graphs: 512, hidden: 32, layers: 2}", "train.batch_size=16"],
    "classifier": [
        "task.options={per_module: 60, max_length: 64, hidden: 32, layers: 1}",
        "train.batch_size=8",
    ],
    "molecules": ["task.options={molecules: 512, hidden: 32, layers: 2}", "train.batch_size=16"],
}


def example(name: str, run: Path, *sets: str) -> list[str]:
    """`qgtrain train` arguments for jobs/<name>.yaml: EXAMPLE_STEPS steps, a checkpoint every 4."""
    return [
        "train",
        "--config",
        str(ROOT / "config.yaml"),
        "--config",
        str(ROOT / "jobs" / f"{name}.yaml"),
        "--run-dir",
        str(run),
        "--set",
        *EXAMPLES[name],
        f"train.max_steps={EXAMPLE_STEPS}",
        "train.log_every=1",
        "train.eval_every=8",
        "checkpoint.every_steps=4",
        "early_stopping.patience=0",
        "optim.warmup_steps=4",
        "logging.tensorboard=false",
        *sets,
    ]


def example_eval_items(folder: Path) -> Path:
    """jobs/eval.yaml's three task files, made as its comment says, in `folder`/data/eval."""
    script = ROOT / "jobs" / "examples" / "eval_data.py"
    done = subprocess.run(
        [sys.executable, str(script), "--items", "6", "--modules", "40"],
        cwd=folder,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return folder / "data" / "eval" / "next_line.jsonl"


# A small GPT-2 that fsdp can shard (two blocks), for the sharded runs (test_fsdp.py,
# test_big_models.py).
SMALL_GPT2 = [
    "data.name=synthetic",
    "data.synthetic_samples=2048",
    "data.seq_len=32",
    "model.hidden=64",
    "model.layers=2",
    "model.heads=2",
    "train.batch_size=6",
    "train.log_every=1",
    "train.eval_every=8",
    "train.eval_batches=2",
    "checkpoint.every_steps=4",
    "optim.warmup_steps=4",
    "logging.tensorboard=false",
]


def small_gpt2_run(run: Path, *sets: str) -> list[str]:
    return [
        "train",
        "--config",
        str(ROOT / "config.yaml"),
        "--run-dir",
        str(run),
        "--set",
        *SMALL_GPT2,
        *sets,
    ]


def tiny_gpt2() -> torch.nn.Module:
    """A two-block GPT-2 of width 32, the same on every call (seeded)."""
    from qgtrain.config import ModelConfig
    from qgtrain.runtime import rng
    from qgtrain.tasks.models import build_model

    rng.seed_everything(0)
    return build_model(ModelConfig(layers=2, heads=2, hidden=32), 257, 16, 256)


SMALL_SIZES: dict[str, dict[str, int]] = {
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64},
    "llama": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    },
}


def byte_config(model_type: str, **fields: Any) -> Any:
    """A small Hugging Face config over the byte vocabulary (256 bytes and the end token 256), two
    layers of width 32 unless `fields` say otherwise: the models tests save and load as a user's."""
    import transformers

    sizes = {**SMALL_SIZES[model_type], **fields}
    return transformers.AutoConfig.for_model(
        model_type, vocab_size=257, bos_token_id=256, eos_token_id=256, **sizes
    )


def works_once(tmp: str, hidden_on_rank_1: bool, limit_s: float = 60.0, work_s: float = 1.0) -> Any:
    """One rank of a group at distributed.main_works_long: rank 0 works for `work_s`, leaving
    worked-<rank> in `tmp`, and returns tmp/result-by-<rank>; with `hidden_on_rank_1`, rank 1
    stands for a node that cannot see rank 0's result. A rank that gives up returns its error as
    'Type: message'."""
    from qgtrain.foundation.errors import QgtrainError
    from qgtrain.runtime import distributed
    from qgtrain.runtime.rendezvous import from_environ

    env = from_environ(os.environ)

    def work() -> str:
        Path(tmp, f"worked-{env.rank}").write_text("1")
        time.sleep(work_s)
        return f"{tmp}/result-by-{env.rank}"

    with distributed.process_group(env, torch.device("cpu"), 60, 60):
        try:
            return distributed.main_works_long(
                work,
                "works",
                ("data.prepare_timeout_s", limit_s),
                lambda value: not (hidden_on_rank_1 and env.rank == 1),
            )
        except QgtrainError as exc:
            return f"{type(exc).__name__}: {exc}"


def kill_rank(job_id: str, rank: int) -> None:
    """SIGKILL the training process of one rank of a running Slurm job (it shows in /proc: the test
    cluster's nodes are network namespaces of this machine), started by train.slurm or by
    submitit."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        training = b"qgtrain\0train" in cmdline or b"submitit.core._submit" in cmdline
        # srun's own command line names the same, and the batch shell's SLURM_PROCID is 0
        launcher = Path(cmdline.split(b"\0")[0].decode(errors="replace")).name == "srun"
        if (
            training
            and not launcher
            and f"SLURM_JOB_ID={job_id}".encode() in environ
            and f"SLURM_PROCID={rank}".encode() in environ
        ):
            os.kill(int(pid), signal.SIGKILL)
            return
    raise AssertionError(f"no training process of rank {rank} in job {job_id}")


def records(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    """A run's metrics.jsonl (or a copy of it named `name`), skipping a last line cut short by a
    kill."""
    path = run_dir / name
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def overlay(
    tmp_path: Path,
    max_steps: int,
    every_steps: int = 0,
    task_options: dict[str, object] | None = None,
) -> Path:
    """A small run under tmp_path: the built-in LM, or with task_options the task of a job file laid
    under it (its own options, its validations kept, early stopping off so the step count is
    fixed)."""
    path = tmp_path / "small.yaml"
    path.write_text(
        (
            f"""
data: {{name: synthetic, seq_len: 32, synthetic_samples: 2048}}
model: {{layers: 1, hidden: 32, heads: 2}}
train: {{max_steps: {max_steps}, batch_size: 8, log_every: 50, eval_every: 0}}
"""
            if task_options is None
            else f"""
task: {{options: {json.dumps(task_options)}}}
train: {{max_steps: {max_steps}, log_every: 10}}
early_stopping: {{patience: 0}}
"""
        )
        + f"""checkpoint: {{every_steps: {every_steps}}}
logging: {{tensorboard: false, runs_dir: {tmp_path / "runs"}}}
"""
    )
    (tmp_path / "jobs" / "out").mkdir(parents=True, exist_ok=True)
    return path


def sleep_paced(tmp_path: Path, step_s: float = 0.05) -> Path:
    """Training steps that are a sleep of step_s (tests/tasks.py slow_evaluation), validations off:
    for a test that waits out a real time limit, so that its minutes leave the CPUs to the tests
    running beside it."""
    path = tmp_path / "paced.yaml"
    path.write_text(
        f"task: {{factory: '{ROOT / 'tests' / 'tasks.py'}:slow_evaluation', "
        f"options: {{size: 4096, step_s: {step_s}}}}}\ntrain: {{eval_every: 0, cpu_threads: 1}}\n"
    )
    return path


# The two-node run that interrupted, requeued and retried runs must end equal to (conftest's
# two_node_reference): the same settings whatever their checkpoint interval, which does not change
# training.
TWO_NODE_STEPS = 600


# tests/tasks.py's points as a job's task: no transformers for each rank of each start to import
# (seconds of CPU a start, which the tests beside these need).
POINTS_TASK = {"factory": f"{ROOT / 'tests' / 'tasks.py'}:points", "options": {"size": 2048}}


def points_task(tmp_path: Path) -> Path:
    """A config file of POINTS_TASK, laid over a job's others."""
    task = tmp_path / "points.yaml"
    task.write_text(f"task: {json.dumps(POINTS_TASK)}\n")
    return task


def two_node_configs(tmp_path: Path, every_steps: int = 100) -> list[Path]:
    """The two-node run on tests/tasks.py's points (POINTS_TASK)."""
    return [
        ROOT / "config.yaml",
        ROOT / "jobs" / "cpu.yaml",
        overlay(tmp_path, TWO_NODE_STEPS, every_steps),
        points_task(tmp_path),
    ]


def sbatch(tmp_path: Path, *options: str, configs: list[Path]) -> str:
    result = subprocess.run(
        ["sbatch", "--parsable", *options, str(ROOT / "train.slurm"), *map(str, configs)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=True,
    )
    return result.stdout.strip().split(";")[0]


def job(job_id: str) -> dict[str, str]:
    shown = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True
    ).stdout
    return dict(field.split("=", 1) for field in shown.split() if "=" in field)


def wait_until(condition, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    """wait_for with no process of ours to watch: the scheduler's jobs, polled twice a second."""
    wait_for(condition, (), what, timeout, pause=0.5)


def wait_finished(job_id: str, timeout: float = 300) -> str:
    wait_until(lambda: job(job_id).get("JobState") in FINISHED, timeout, f"job {job_id} to finish")
    return job(job_id)["JobState"]


class JobWeights(Mapping[str, torch.Tensor]):
    """A Slurm job's final weights, read when first looked at: the job trains meanwhile, beside the
    test's own job, instead of before it."""

    def __init__(self, job_id: str, run_dir: Path, step: int) -> None:
        self.job_id, self.run_dir, self.step = job_id, run_dir, step
        self._weights: dict[str, torch.Tensor] | None = None

    def _read(self) -> dict[str, torch.Tensor]:
        if self._weights is None:
            state = wait_finished(self.job_id, timeout=600)
            assert state == "COMPLETED", f"reference job {self.job_id}: {state}"
            self._weights = final_weights(self.run_dir, self.step)
        return self._weights

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._read()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._read())

    def __len__(self) -> int:
        return len(self._read())


def logged_step(run_dir: Path) -> int:
    try:
        return max(record["step"] for record in records(run_dir))
    except (FileNotFoundError, ValueError):
        return 0


def final_weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step-{step}" / "model.pt", weights_only=True)


def rank_log(run_dir: Path, rank: int) -> str:
    """A rank's log so far ('' before the rank has opened it)."""
    try:
        return (run_dir / "logs" / f"rank_{rank}.log").read_text()
    except FileNotFoundError:
        return ""


# Hostlists in the forms Slurm writes and accepts, and their hosts: checked against expand_nodelist
# and against the test cluster's own `scontrol show hostnames`.
NODELISTS = [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("nid[00010-00012]", ["nid00010", "nid00011", "nid00012"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("gpu-a[1-2],gpu-b1", ["gpu-a1", "gpu-a2", "gpu-b1"]),
    ("my-node-01", ["my-node-01"]),
    ("linux[1,2]", ["linux1", "linux2"]),
    ("a[3],b[1-2]", ["a3", "b1", "b2"]),
    ("node[9-11]", ["node9", "node10", "node11"]),
    ("x[3,1]", ["x3", "x1"]),
    ("n[1-2]-ib[0-1]", ["n1-ib0", "n1-ib1", "n2-ib0", "n2-ib1"]),
    # Slurm separates on spaces and tabs too; python-hostlist does not
    ("a1 b[2-3]", ["a1", "b2", "b3"]),
    ("gpu[01-02]\tgpu07", ["gpu01", "gpu02", "gpu07"]),
    ("x1, x[2,4] ", ["x1", "x2", "x4"]),
]


def stand_in_sbatch(tmp_path: Path) -> dict[str, str]:
    """The environment of a `qgtrain submit` that reaches sbatch without the Slurm test cluster:
    sbatch is a script that logs its working directory and script to `<tmp_path>/sbatch.log` and
    prints the next job id (101, 102, ...). For what submit writes and checks before sbatch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(
        '#!/bin/bash\necho "$PWD $2" >> "$FAKE_SBATCH_LOG"\n'
        'n=$(wc -l < "$FAKE_SBATCH_LOG"); echo $((100 + n))\n'
    )
    (bin_dir / "sbatch").chmod(0o755)
    return {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "FAKE_SBATCH_LOG": str(tmp_path / "sbatch.log"),
    }


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    """A refusal as the CLI gives it: exit 2, one `qgtrain: error:` line (the last), no
    traceback."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and done.stderr.count("qgtrain: error: ") == 1, (
        done.stderr[-3000:]
    )
    return done.stderr.splitlines()[-1]


# Data files as users bring them: documents of known words, written as JSON Lines.
WORDS = (
    "rank node slurm batch token model epoch shard cache resume signal queue gradient optimizer "
    "loss données über naïve 東京"
).split()


def documents(count: int, seed: int, words: int = 40) -> list[str]:
    rng = random.Random(seed)
    return [
        f"doc {seed}-{i}: " + " ".join(rng.choices(WORDS, k=rng.randint(1, words))) + "\nend."
        for i in range(count)
    ]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    lines = "".join(json.dumps({"id": i, field: doc}) + "\n" for i, doc in enumerate(docs))
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(lines.encode()))
    else:
        path.write_text(lines)
    return path


def data(  # type: ignore[no-untyped-def]
    tmp_path: Path, *files: str | Path, **changes
) -> DataConfig:
    return replace(
        DataConfig(name="files", files=tuple(map(str, files)), cache_dir=str(tmp_path / "cache")),
        **changes,
    )


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Two state dicts hold the same names and bit-for-bit the same tensors."""
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def assert_resumed_equals(reference: Path, run: Path, context: str, max_steps: int = 16) -> None:
    """The promise, compared one way everywhere: a resumed `run` equals the uninterrupted
    `reference` in every step's loss and validation, and in the final weights and optimizer state,
    bit for bit. `context` says where it was stopped (a seed, a step)."""
    expected, got = records(reference), records(run)
    assert [r["step"] for r in got] == list(range(1, max_steps + 1)), context
    for want, have in zip(expected, got):
        assert (have["loss"], have.get("val_loss")) == (want["loss"], want.get("val_loss")), (
            f"step {want['step']} {context}"
        )
    final = f"step-{max_steps}"
    want_state, have_state = (checkpoint_state(r / "checkpoints" / final) for r in (reference, run))
    assert_same_tensors(want_state, have_state)


# Mixtures and streams of data files, as the mix and stream tests build them.
MIX_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda".split()


def write_mix_source(path: Path, count: int, seed: int, length: tuple[int, int] = (20, 40)) -> None:
    """A mixture's source: `count` JSON Lines documents named by the file and their index."""
    rng = random.Random(seed)
    with open(path, "w") as out:
        for index in range(count):
            words = " ".join(rng.choices(MIX_WORDS, k=rng.randint(*length)))
            out.write(json.dumps({"text": f"{path.stem} {index}: {words}"}) + "\n")


def mix_setting(
    folder: Path, code: str | None = None, web: str | None = None, weights: str = "6, 3"
) -> str:
    """--set data.mix= of two sources, web and code (folder/web.jsonl, folder/code.jsonl)."""
    code = code or str(folder / "code.jsonl")
    web = web or str(folder / "web.jsonl")
    heavy, light = weights.split(", ")
    return (
        f"data.mix=[{{name: web, files: ['{web}'], weight: {heavy}}}, "
        f"{{name: code, files: ['{code}'], weight: {light}}}]"
    )


def streamed_files(pattern: str, val_fraction: float = 0.1) -> DataConfig:
    """Files streamed in samples of 16 tokens, as stream_settings sets them, for a test's plan."""
    return DataConfig(
        name="files",
        files=(pattern,),
        stream=True,
        seq_len=16,
        val_fraction=val_fraction,
        test_fraction=0.0,
    )


def stream_settings(data: Path, *more: str, batch: int = 2) -> list[str]:
    """A streamed run over `data`/part-*.jsonl as the stream tests train it: 2 loader workers, the
    recording model (which writes the sample ids each rank trains on)."""
    return [
        "--set",
        "data.name=files",
        f"data.files=[{data}/part-*.jsonl]",
        "data.stream=true",
        "data.seq_len=16",
        "data.val_fraction=0.1",
        "data.test_fraction=0",
        f"train.batch_size={batch}",
        "data.num_workers=2",
        "model.factory=tests.stream_tasks:recording_lm",
        "train.log_every=1",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=8",
        "logging.tensorboard=false",
        "optim.warmup_steps=0",
        "optim.schedule=constant",
        "train.eval_every=100",
        *more,
    ]
