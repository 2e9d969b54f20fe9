"""Operating runs: `qgtrain runs`, `plot`, `doctor`, and the diagnosed failures (a dead or hung
peer, a dead DataLoader worker, out-of-memory, parameters unused on some steps, memory warnings).
Runs against: real `qgtrain` processes (killed, stopped and signalled for real) and real 2-rank gloo
groups."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qgtrain.config.load import load_config
from tests.helpers import TINY, cli, lines_in, records, tiny_config, train_command, wait_for
from tests.ranks import kill_ranks, run_ranks, start_cli_ranks, train_rank, wait_ranks


def wait_for_step(  # type: ignore[no-untyped-def]
    run: Path, step: int, procs, timeout: float = 120
) -> None:
    wait_for(lambda: lines_in(run / "metrics.jsonl") >= step, procs, f"step {step}", timeout, 0.05)


def test_runs_table_tells_finished_failed_stopped_running_and_interrupted_apart(tmp_path):
    runs = tmp_path / "runs"
    done = tiny_config("train.max_steps=20", "train.eval_every=10", "checkpoint.every_steps=10")
    assert run_ranks(1, train_rank, done, str(runs / "done"))[0]["exit"] == 0
    unused = tiny_config("model.factory=tests.factories:with_unused_head", "train.max_steps=5")
    failed = run_ranks(2, train_rank, unused, str(runs / "broken"))
    assert [r["exit"] for r in failed] == [1, 1]
    long = ["train", "--set", *TINY, "train.max_steps=100000", "checkpoint.every_steps=20"]
    stopped = start_cli_ranks(
        1, [*long, "--run-dir", str(runs / "stopped")], tmp_path, log_prefix="stopped"
    )
    live = start_cli_ranks(1, [*long, "--run-dir", str(runs / "live")], tmp_path, log_prefix="live")
    killed = start_cli_ranks(
        1, [*long, "--run-dir", str(runs / "killed")], tmp_path, log_prefix="killed"
    )
    try:
        for name, procs in (("stopped", stopped), ("live", live), ("killed", killed)):
            wait_for_step(runs / name, 25, procs)
        os.kill(stopped[0].pid, signal.SIGUSR2)
        assert wait_ranks(stopped, 60) == [75]
        kill_ranks(killed)
        table = cli("runs", str(runs), cwd=tmp_path)
        rows = {
            r["name"]: r for r in json.loads(cli("runs", str(runs), "--json", cwd=tmp_path).stdout)
        }
    finally:
        kill_ranks(live + killed + stopped)
    assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:3] == [
        "RUN",
        "STATUS",
        "STEP",
    ]
    assert {name: row["status"] for name, row in rows.items()} == {
        "done": "finished",
        "broken": "failed",
        "stopped": "stopped",
        "live": "running",
        "killed": "interrupted",
    }
    done = rows["done"]
    assert (done["step"], done["epoch"], done["checkpoint"], done["job_id"]) == (20, 0, 20, None)
    assert done["best_metric"] == "val_loss" and done["best"] <= done["last_val_loss"]
    assert rows["killed"]["checkpoint"] is not None and rows["killed"]["checkpoint"] % 20 == 0
    assert "received no gradient" in rows["broken"]["error"] and "broken: " in table.stdout


def test_runs_answers_without_importing_torch(tmp_path):
    code = (
        "import sys; from qgtrain.interface.cli import main; main(['runs', "
        + repr(str(tmp_path))
        + "]); "
        "print([m for m in ('torch', 'transformers') if m in sys.modules], file=sys.stderr)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stderr.strip() == "[]" and f"no runs in {tmp_path}" in result.stdout


def test_plot_overlays_runs_with_labelled_axes(tmp_path):
    for name, lr in (("lr-high", "0.01"), ("lr-low", "0.001")):
        sets = ("train.max_steps=30", "train.eval_every=10", f"optim.lr={lr}", f"optim.min_lr={lr}")
        assert run_ranks(1, train_rank, tiny_config(*sets), str(tmp_path / name))[0]["exit"] == 0
    out = tmp_path / "curves.png"
    result = cli(
        "plot", str(tmp_path / "lr-high"), str(tmp_path / "lr-low"), "--out", str(out), cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    bad = cli(
        "plot",
        str(tmp_path / "lr-high"),
        "--out",
        str(out),
        "--metric",
        "loss,accuracy",
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and "accuracy not logged by these runs; available: " in bad.stderr


def test_doctor_lists_every_check_and_fails_on_an_error(tmp_path):
    result = cli("doctor", "--set", f"logging.runs_dir={tmp_path / 'runs'}", cwd=tmp_path)
    for name in (
        "python",
        "GPUs",
        "shared memory",
        "run directory",
        "rendezvous port",
        "network",
        "Hugging Face",
    ):
        assert f" {name} " in result.stdout, result.stdout
    assert "network            " in result.stdout and "lo 127.0.0.1" in result.stdout
    # this machine (CPU only, a writable run directory, no GPU asked for) has nothing to fix:
    # warnings at most
    assert result.returncode == 0 and "\n  error " not in result.stdout, result.stdout
    broken = cli(
        "doctor",
        "--set",
        f"logging.runs_dir={tmp_path}",
        "model.pretrained=/no/such/model",
        cwd=tmp_path,
    )
    assert (
        broken.returncode == 1
        and "error    model.pretrained" in broken.stdout
        and "fix: point it" in broken.stdout
    )
    no_such = cli(
        "doctor", "--set", f"logging.runs_dir={tmp_path}", "train.socket_ifname=nope0", cwd=tmp_path
    )
    assert no_such.returncode == 1 and "error    network" in no_such.stdout, no_such.stdout
    assert "train.socket_ifname: 'nope0' is not a network interface of" in no_such.stdout


def test_doctor_builds_the_task_on_the_cpu_and_names_what_fails(tmp_path):
    """A task that does not import or build fails the checklist in one line naming it; one that
    builds only inside a process group is told apart, since doctor starts none."""
    (tmp_path / "broken.py").write_text(
        "def build(cfg):\n    raise ValueError('no data in /scratch/me')\n"
    )
    runs_dir = f"logging.runs_dir={tmp_path / 'runs'}"

    def doctor(task: str) -> tuple[int, str]:
        result = cli("doctor", "--set", runs_dir, f"task={task}", cwd=tmp_path)
        (line,) = [line for line in result.stdout.splitlines() if line[11:].startswith("task ")]
        return result.returncode, line

    here = tmp_path.resolve()
    code, line = doctor("nope.py:build")
    assert code == 1 and line.split()[0] == "error", line
    assert f"cannot load '{here / 'nope.py'}:build' (no file {here / 'nope.py'})" in line
    code, line = doctor("broken.py:make")
    assert code == 1 and f"cannot load '{here / 'broken.py'}:make'" in line
    assert "has no attribute 'make'" in line
    code, line = doctor("broken.py:build")
    assert code == 1 and line.split()[0] == "error", line
    assert f"{here / 'broken.py'}:build raised ValueError: no data in /scratch/me" in line
    code, line = doctor("tests.tasks:points")
    assert code == 0 and line.split()[0] == "ok", line
    assert "Sequential of 178 parameters, train 512, val 131, test 37" in line
    code, line = doctor("tests.tasks:slow_on_rank_zero")  # asks torch.distributed for its rank
    assert code == 0 and line.split()[0] == "warning" and "does not start" in line, line


@pytest.mark.parametrize("how", ["killed", "hung"])
def test_when_a_peer_dies_or_hangs_the_other_rank_stops_in_bounded_time_naming_it(tmp_path, how):
    run = tmp_path / "run"
    procs = start_cli_ranks(
        2,
        train_command(
            run,
            *TINY,
            "train.max_steps=100000",
            "train.collective_timeout_s=10",
        ),
        tmp_path,
    )
    try:
        wait_for_step(run, 10, procs)
        os.kill(procs[1].pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        start = time.monotonic()
        assert procs[0].wait(timeout=60) == 1
        elapsed = time.monotonic() - start
    finally:
        kill_ranks(procs)
    log = (run / "logs" / "rank_0.log").read_text()
    assert "a collective failed in step" in log and "on rank 0: rank(s) [1] did not arrive" in log
    assert "--- rank stacks at" in log and "File " in log, (
        "rank 0 wrote its Python stacks to its log"
    )
    output = (tmp_path / "rank-0.out").read_text()
    assert "qgtrain: error: a collective failed" in output and "Traceback" not in output
    assert elapsed < (15 if how == "killed" else 10 + 30), f"took {elapsed:.0f}s"


def test_a_rank_that_stops_making_progress_dumps_its_stacks_and_exits_within_the_bound():
    """The per-step watchdog, in a real process: alive for longer than its bound while steps
    complete, then its stacks and a non-zero exit between `seconds` and `seconds + slack` after the
    last step."""
    # the clock is read before each progress() call, so the last reading is no later than the last
    # progress
    code = (
        "import time\nfrom qgtrain.runtime.diagnose import ProgressWatchdog\nwatchdog = "
        "ProgressWatchdog(2.0)\nfor _ in range(30):\n    last = time.monotonic()\n    "
        "watchdog.progress()\n    time.sleep(0.1)\nprint('last progress', last, "
        "flush=True)\ntime.sleep(60)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    ended = time.monotonic()
    assert result.returncode != 0 and "Timeout (0:00:02.200000)!" in result.stderr
    assert 'File "<string>", line 9 in <module>' in result.stderr, "the stuck line is in the dump"
    silent_for = ended - float(result.stdout.split()[-1])
    assert 2.0 <= silent_for < 2.2 + 5, f"exited {silent_for:.1f}s after the last progress"


def train_watching_the_watchdog(config, run_dir: str) -> dict:  # type: ignore[no-untyped-def]
    """One rank of `qgtrain train` whose progress watchdog records how it is armed and fed."""
    from qgtrain.runtime import diagnose

    seen = {"bounds": [], "progress": 0}

    class Recording(diagnose.ProgressWatchdog):
        def __init__(self, seconds: float) -> None:
            super().__init__(seconds)
            seen["bounds"].append(seconds)

        def progress(self) -> None:
            seen["progress"] += 1
            super().progress()

    diagnose.ProgressWatchdog = Recording  # type: ignore[misc]
    return {**train_rank(config, run_dir), **seen}


def test_the_trainer_feeds_the_progress_watchdog_every_step_with_the_documented_bound(tmp_path):
    """The watchdog itself is tested above; this is its wiring: armed once per start with twice the
    collective timeout plus 5 minutes, and fed at every step."""
    config = tiny_config("train.max_steps=7", "train.collective_timeout_s=20")
    result = run_ranks(1, train_watching_the_watchdog, config, str(tmp_path / "run"))[0]
    assert (result["exit"], result["bounds"], result["progress"]) == (0, [2 * 20 + 300], 7)


def test_a_dead_dataloader_worker_is_explained(tmp_path):
    sets = (
        "data.name=factory",
        "data.factory=tests.factories:data_with_dying_worker",
        "data.num_workers=2",
        "train.max_steps=200",
        "train.eval_every=0",
    )
    result = run_ranks(1, train_rank, tiny_config(*sets), str(tmp_path / "run"))[0]
    assert result["exit"] == 1
    assert "a DataLoader worker of rank 0 died in step" in result["error"]
    assert (
        "shared memory (/dev/shm has" in result["error"] and "data.num_workers" in result["error"]
    )


def test_out_of_memory_is_explained_with_the_fix(tmp_path):
    result = run_ranks(
        1,
        train_rank,
        tiny_config("model.factory=tests.factories:out_of_memory_at_step_two", "train.max_steps=5"),
        str(tmp_path / "run"),
    )[0]
    assert result["exit"] == 1 and "rank 0 ran out of GPU memory in step 2" in result["error"]
    assert "train.grad_accum_steps" in result["error"]


def test_parameters_unused_on_some_steps_are_explained(tmp_path):
    results = run_ranks(
        2,
        train_rank,
        tiny_config(
            "model.factory=tests.factories:sometimes_unused",
            "train.max_steps=6",
            "train.eval_every=0",
        ),
        str(tmp_path / "run"),
    )
    for result in results:
        assert result["exit"] == 1
        assert (
            "received no gradient in step 2 on some rank(s): they were unused on that step only"
            in result["error"]
        )
        assert "train.find_unused_parameters: true" in result["error"]
    fine = run_ranks(
        2,
        train_rank,
        tiny_config(
            "model.factory=tests.factories:sometimes_unused",
            "train.max_steps=6",
            "train.eval_every=0",
            "train.find_unused_parameters=true",
        ),
        str(tmp_path / "run2"),
    )
    assert [r["exit"] for r in fine] == [0, 0]


def test_memory_is_logged_and_a_limit_warns(tmp_path):
    run = tmp_path / "run"
    config = tiny_config("train.max_steps=3", "logging.memory_warn_gb=0.01")
    assert run_ranks(1, train_rank, config, str(run))[0]["exit"] == 0
    record = records(run)[0]
    assert record["mem_rss_gb"] > 0.01
    log = (run / "logs" / "rank_0.log").read_text()
    assert log.count("mem_rss_gb is") == 1 and "above logging.memory_warn_gb=0.01" in log


# (device name as torch reports it, the run's precision, the expected dense peak in TFLOP/s or None)
PEAK_TABLE = [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
    ("NVIDIA H100 PCIe", "bf16", 756.5),
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H100 80GB HBM3", "fp32", 66.9),
    ("NVIDIA H100 80GB HBM3", "tf32", 494.7),
    ("Tesla V100-SXM2-32GB", "tf32", 15.7),
    ("NVIDIA H800", "bf16", 989.4),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA GH200 480GB", "bf16", 989.4),
    ("NVIDIA L40S", "bf16", 362.1),
    ("NVIDIA L40", "bf16", 181.0),
    ("NVIDIA L4", "bf16", 121.0),
    ("NVIDIA A40", "bf16", 149.7),
    ("NVIDIA RTX A4000", "bf16", None),
    ("NVIDIA A10", "bf16", 125.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312.0),
    ("NVIDIA A100 80GB PCIe", "fp16", 312.0),
    ("Tesla V100-SXM2-32GB", "fp16", 125.0),
    ("Tesla V100-SXM2-32GB", "bf16", None),
    ("Tesla T4", "fp32", 8.1),
    ("AMD Instinct MI250X", "bf16", 191.5),
    ("AMD Instinct MI300X", "bf16", 1307.4),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2),
    ("Some Future Accelerator", "bf16", None),
]


@pytest.mark.parametrize("name,precision,tflops", PEAK_TABLE)
def test_model_flops_utilisation_uses_the_peak_of_the_exact_device_and_precision(
    name, precision, tflops
):
    """Names nest (L40 and L4, RTX A4000 and A40, H100 PCIe and H100): each is matched whole; an
    MI250X shows up as one GCD, half the module; V100 and T4 have no bf16 to measure against."""
    from qgtrain.training.flops import peak_flops

    assert peak_flops(name, precision) == (None if tflops is None else pytest.approx(tflops * 1e12))


def test_train_peak_tflops_overrides_the_table_and_mfu_needs_a_peak():
    import torch

    from qgtrain.training.flops import device_peak, utilisation

    assert device_peak(torch.device("cpu"), "bf16") is None
    assert device_peak(torch.device("cpu"), "bf16", 100.0) == 100e12
    assert utilisation(1e12, 50.0, 100e12, 2) == {"mfu": 0.25}
    assert utilisation(1e12, 50.0, None, 2) == {} and utilisation(None, 50.0, 100e12, 2) == {}


def test_training_flops_count_matrix_products_not_embedding_lookups():
    from qgtrain.tasks.causal_lm import training_flops
    from qgtrain.tasks.models import build_model

    model = build_model(load_config([]).model, 257, 128, 256)  # the main job's GPT-2, its head tied
    params = sum(p.numel() for p in model.parameters())
    positions = model.transformer.wpe.weight.numel()
    assert model.lm_head.weight is model.transformer.wte.weight
    assert training_flops(model, 128) == 128 * (6 * (params - positions) + 12 * 4 * 128 * 128)


@pytest.mark.slow
def test_a_compiled_sharded_model_trains_as_eager_and_keeps_its_compile_cache_in_the_run(tmp_path):
    """model.compile under fsdp on 2 ranks: each block compiled, then sharded (FSDP's hooks outside
    the compiled graphs), the losses those of the eager run to fp32 rounding. Each rank's inductor
    cache goes under the run directory (a requeue on another node finds it there), and a start on
    one rank resumes from the checkpoint and from rank 0's cache."""
    sets = [
        *TINY,
        "model.factory=null",
        "model.layers=2",
        "model.hidden=32",
        "model.heads=2",
        "train.eval_every=0",
        "checkpoint.every_steps=0",
        "train.parallel=fsdp",
    ]
    runs = {}
    for compiled in ("false", "true"):
        run = tmp_path / f"compile-{compiled}"
        args = ["train", "--run-dir", str(run), "--set", *sets, "train.max_steps=4"]
        ranks = start_cli_ranks(
            2, [*args, f"model.compile={compiled}"], tmp_path, log_prefix=compiled
        )
        assert wait_ranks(ranks, 300) == [0, 0], (tmp_path / f"{compiled}-0.out").read_text()[
            -3000:
        ]
        runs[compiled] = run
    eager, compiled_run = (records(runs[c]) for c in ("false", "true"))
    assert [r["step"] for r in compiled_run] == [1, 2, 3, 4]
    for a, b in zip(eager, compiled_run):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
    log = (tmp_path / "true-0.out").read_text()
    assert "model.compile: true: compiling the 2 GPT2Block blocks" in log, log[-3000:]
    for rank in (0, 1):
        cache = runs["true"] / "compile-cache" / f"rank-{rank}"
        assert [p for p in cache.rglob("*") if p.is_file()], "compiled kernels kept in the run"
    resumed = [*sets, "model.compile=true", "train.max_steps=6"]
    again = cli("train", "--run-dir", str(runs["true"]), "--set", *resumed, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"torch.compile caches in {runs['true'] / 'compile-cache' / 'rank-0'}" in again.stderr
    assert "resuming a 2-rank checkpoint on 1 ranks" in again.stderr


def test_runs_shows_early_stops_requeues_and_each_failed_step_from_the_run_directory(tmp_path):
    """What rank 0 and `qgtrain recover` record in status.json, as `qgtrain runs` shows it (no run
    needed: the table is read from the files alone)."""
    from qgtrain.runs import rundir

    killed = {"rank": 1, "node": "node2", "how": "Killed", "action": "retry"}
    requeued = {**killed, "action": "requeue node2"}
    spared = {**killed, "node": "node3", "action": "retry node3"}
    fewer = {**killed, "node": "node1", "action": "retry node1 1"}
    for name, status, facts in (
        ("early", "stopped early", {}),
        ("requeued", "preempted", {"requeued": True}),
        ("pending", "preempted", {"requeued": None}),
        ("local", "preempted", {"requeued": False}),
        ("crashed", "running", {"restart": 1, "failures": [spared, fewer, killed, requeued]}),
    ):
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.json").write_text(json.dumps({"run_id": name}))
        # "running" with nobody holding the lock: killed
        rundir.write_status(tmp_path / name, status, **facts)
    rows = {
        r["name"]: r for r in json.loads(cli("runs", str(tmp_path), "--json", cwd=tmp_path).stdout)
    }
    assert {name: row["status"] for name, row in rows.items()} == {
        "early": "stopped early",
        "requeued": "preempted, requeued",
        "pending": "preempted, requeue pending",
        "local": "stopped",
        "crashed": "interrupted",
    }
    assert rows["crashed"]["failures"] == [
        "rank 1 on node3: Killed -> retry on a spare node, without node3",
        "rank 1 on node1: Killed -> retry on 1 node(s), without node1",
        "rank 1 on node2: Killed -> retry",
        "rank 1 on node2: Killed -> requeue node2",
    ]
    table = cli("runs", str(tmp_path), cwd=tmp_path).stdout
    assert "crashed: failed step 4: rank 1 on node2: Killed -> requeue node2" in table
    fewer_line = (
        "crashed: failed step 2: rank 1 on node1: Killed -> retry on 1 node(s), without node1"
    )
    assert fewer_line in table


def test_runs_best_follows_each_runs_early_stopping_metric_and_mode(tmp_path):
    """BEST is what the run's early stopping and best checkpoint follow, read from the config the
    run recorded: the highest val_accuracy for a run that maximises it, not its lowest val_loss."""
    from qgtrain.config.load import dump_yaml
    from qgtrain.runs import rundir

    validations = [(10, 0.70, 0.50), (20, 0.62, 0.90), (30, 0.55, 0.80)]
    for name, sets in (
        ("accuracy", ["early_stopping.metric=val_accuracy", "early_stopping.mode=max"]),
        ("loss", []),
    ):
        run = tmp_path / name
        run.mkdir()
        (run / "run.json").write_text(json.dumps({"run_id": name}))
        (run / "config.yaml").write_text(dump_yaml(load_config([], sets)))
        lines = [
            {"step": step, "epoch": 0, "loss": loss + 0.1, "val_loss": loss, "val_accuracy": acc}
            for step, loss, acc in validations
        ]
        lines[-1].update(test_loss=0.56, test_accuracy=0.79)
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
        rundir.write_status(run, "finished", job_id=None, restart=0, error=None)
    rows = {
        r["name"]: r for r in json.loads(cli("runs", str(tmp_path), "--json", cwd=tmp_path).stdout)
    }
    assert (rows["accuracy"]["best_metric"], rows["accuracy"]["best"]) == ("val_accuracy", 0.90)
    assert (rows["loss"]["best_metric"], rows["loss"]["best"]) == ("val_loss", 0.55)
    assert rows["accuracy"]["last_val_loss"] == rows["loss"]["last_val_loss"] == 0.55
    table = cli("runs", str(tmp_path), cwd=tmp_path).stdout.splitlines()
    assert table[0].split()[:5] == ["RUN", "STATUS", "STEP", "EPOCH", "BEST"]
    cells = {line.split()[0]: line.split()[1:] for line in table[1:]}
    assert cells["accuracy"][:5] == ["finished", "30", "0", "val_accuracy", "0.9000"]
    assert cells["loss"][:5] == ["finished", "30", "0", "val_loss", "0.5500"]
