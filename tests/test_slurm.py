"""qgtrain on a real Slurm cluster: slurmctld and a slurmd per node in their own network
namespaces (node1..node3 in its default partition), started by the `slurm_cluster` fixture. The
shipped train.slurm and qgtrain.submit are used as users use them; preemption and external requeue
are Slurm's own (its time limits: tests/test_slurm_limits.py). The cluster has no accounting (no
sacct), as many don't."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import submitit
import torch

import qgtrain
from tests.helpers import (
    POINTS_TASK,
    ROOT,
    TWO_NODE_STEPS,
    TWO_NODES,
    checkpoint_state,
    final_weights,
    job,
    logged_step,
    overlay,
    points_task,
    rank_log,
    sbatch,
    two_node_configs,
    wait_finished,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


# Runs on tests/tasks.py's points, long enough that a stop requested at step 100 or 150 lands
# mid-run.
LONG = 600


def test_train_slurm_on_two_nodes_completes_with_the_first_node_as_master(tmp_path):
    job_id = sbatch(
        tmp_path,
        *TWO_NODES,
        "--time=5",
        configs=[
            ROOT / "config.yaml",
            ROOT / "jobs" / "cpu.yaml",
            overlay(tmp_path, 60),
            points_task(tmp_path),
        ],
    )
    assert wait_finished(job_id) == "COMPLETED"
    run = tmp_path / "runs" / "cpu"
    assert "rank 0 on node node1 (local rank 0), rendezvous node1:" in rank_log(run, 0)
    assert "rank 1 on node node2 (local rank 0), rendezvous node1:" in rank_log(run, 1)
    assert "2 rank(s) on 2 node(s)" in rank_log(run, 0) and logged_step(run) == 60
    assert f"Slurm job {job_id} restart 0" in rank_log(run, 1)


@pytest.mark.parametrize("interrupt", ["warning signal", "scontrol requeue"])
def test_an_interrupted_job_requeues_resumes_and_ends_as_if_never_stopped(
    tmp_path, two_node_reference, interrupt
):
    """With a node-local tier every 10 steps beside the shared tier's 400: the stop saves to the
    shared tier, and the requeued job resumes from it, not from the older local steps."""
    local = tmp_path / "local.yaml"
    local.write_text(
        f"checkpoint: {{local_dir: '{tmp_path}/disk/$SLURMD_NODENAME', local_every_steps: 10}}\n"
    )
    configs = [*two_node_configs(tmp_path, every_steps=400), local]
    job_id = sbatch(tmp_path, *TWO_NODES, "--time=10", configs=configs)
    run = tmp_path / "runs" / "cpu"
    wait_until(lambda: logged_step(run) >= 100, 120, "training to pass step 100")
    # what --signal=USR2@120 sends before a time limit, or a preemption
    if interrupt == "warning signal":
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    else:  # the SIGTERM path: Slurm requeues, the tasks get SIGTERM and KillWait (5 s) to finish
        subprocess.run(["scontrol", "requeue", job_id], check=True)
    assert wait_finished(job_id) == "COMPLETED"
    assert job(job_id)["Restarts"] == "1", "the same job id came back once"
    log = rank_log(run, 0)
    signal = "SIGUSR2" if interrupt == "warning signal" else "SIGTERM"
    stopped = int(log.split("stopping at step ")[1].split(" ")[0])
    assert f"stopping at step {stopped} on {signal}: checkpoint saved" in log
    assert f"resumed from {run / 'checkpoints' / f'step-{stopped}'}: step {stopped}" in log, (
        "the stop checkpoint was complete before the job was killed"
    )
    assert f"Slurm job {job_id} restart 1" in log
    assert "node-local tier" not in log and list((tmp_path / "disk" / "node2").glob("*/step-*"))
    resumed = final_weights(run, TWO_NODE_STEPS)
    assert all(torch.equal(two_node_reference[k], resumed[k]) for k in two_node_reference), (
        "final weights differ"
    )


GRAPH_STEPS = 250
GRAPH_OPTIONS = {"graphs": 1024, "hidden": 32, "layers": 2}


def graph_configs(tmp: Path) -> list[Path]:
    """jobs/graph.yaml's task (a factory given as a file path relative to the yaml) on the CPU job's
    settings; its run_name, graph, comes after cpu.yaml's and wins."""
    return [
        ROOT / "config.yaml",
        ROOT / "jobs" / "cpu.yaml",
        ROOT / "jobs" / "graph.yaml",
        overlay(tmp, GRAPH_STEPS, every_steps=100, task_options=GRAPH_OPTIONS),
    ]


def signalled_beside_reference(
    tmp_path: Path, configs: Callable[[Path], list[Path]], run: Path, timeout: float
) -> tuple[str, str]:
    """Two-node jobs of `configs`: one (tmp_path/reference) left alone, one USR2ed past step 50."""
    reference = tmp_path / "reference"
    reference.mkdir()
    reference_job = sbatch(reference, *TWO_NODES, "--time=10", configs=configs(reference))
    job_id = sbatch(tmp_path, *TWO_NODES, "--time=10", configs=configs(tmp_path))
    wait_until(lambda: logged_step(run) >= 50, timeout, "training to pass step 50")
    # the warning signal, or a preemption
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
    return reference_job, job_id


def test_a_graph_classifier_is_interrupted_requeued_and_ends_as_if_never_stopped(tmp_path):
    """jobs/graph.yaml's classifier, stopped by the warning signal and requeued, ends as the
    uninterrupted run trained beside it on the same two nodes (so the same thread counts)."""
    reference, run = tmp_path / "reference", tmp_path / "runs" / "graph"
    reference_job, job_id = signalled_beside_reference(tmp_path, graph_configs, run, 120)
    assert wait_finished(job_id) == "COMPLETED"
    assert wait_finished(reference_job) == "COMPLETED"
    graph_reference = reference / "runs" / "graph"
    assert job(job_id)["Restarts"] == "1", "the same job id came back once"
    log = rank_log(run, 0)
    assert log.count(f"task {ROOT / 'jobs' / 'examples' / 'graph.py'}:graph_classifier") == 2, (
        "both allocations found the factory, given relative to jobs/graph.yaml, from the job's own "
        "directory"
    )
    stopped = int(log.split("stopping at step ")[1].split(" ")[0])
    assert 50 <= stopped < GRAPH_STEPS
    assert f"stopping at step {stopped} on SIGUSR2: checkpoint saved" in log
    assert f"resumed from {run / 'checkpoints' / f'step-{stopped}'}: step {stopped}" in log
    assert f"Slurm job {job_id} restart 1" in log
    final = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    expected = json.loads((graph_reference / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["step"] == GRAPH_STEPS and {"val_accuracy", "test_accuracy"} <= final.keys()
    assert {k: v for k, v in final.items() if k.startswith(("val_", "test_"))} == {
        k: v for k, v in expected.items() if k.startswith(("val_", "test_"))
    }
    reference, resumed = (
        final_weights(graph_reference, GRAPH_STEPS),
        final_weights(run, GRAPH_STEPS),
    )
    assert reference.keys() == resumed.keys()
    assert all(torch.equal(reference[k], resumed[k]) for k in reference), "final weights differ"


def submit_small(  # type: ignore[name-defined]
    tmp_path: Path, max_steps: int
) -> qgtrain.launch.submitit_launcher.TrainJob:
    return qgtrain.submit(
        overlay(tmp_path, max_steps),
        folder=tmp_path / "submitit",
        slurm__nodes=2,
        slurm__cpus_per_task=1,
        train__run_name="submitit",
        train__device="cpu",
        task__factory=POINTS_TASK["factory"],
        task__options=POINTS_TASK["options"],
    )


def test_submitit_job_is_interrupted_requeued_and_resumed_to_a_result(tmp_path):
    job = submit_small(tmp_path, LONG)
    run = tmp_path / "runs" / "submitit"
    wait_until(lambda: logged_step(run) >= 100, 180, "training to pass step 100")
    job._interrupt()  # SIGTERM then USR2, as a preemption does
    result = job.result(timeout=300)
    assert "requeueing through submitit" in job._sub_jobs[0].stderr()
    assert result == {"run_dir": str(run), "exit_code": 0}
    log = rank_log(run, 0)
    assert "checkpoint saved" in log and "resumed from" in log and logged_step(run) == LONG
    # this cluster has no accounting: the state comes from squeue (submitit alone would say UNKNOWN)
    wait_until(
        lambda: job.watcher.get_state(job.job_id, mode="force") == "COMPLETED",
        60,
        "state COMPLETED",
    )


def test_a_cancelled_submitit_job_raises_instead_of_hanging(tmp_path):
    job = submit_small(tmp_path, 10**6)
    wait_until(lambda: logged_step(tmp_path / "runs" / "submitit") >= 50, 180, "training to start")
    job.cancel()
    # not the wait's TimeoutError
    with pytest.raises(submitit.core.utils.UncompletedJobError, match="CANCELLED"):
        job.result(timeout=120)
    assert "checkpoint saved" in rank_log(tmp_path / "runs" / "submitit", 0)
    assert "not requeued: the job is ending (COMPLETING" in job._sub_jobs[0].stderr()


def test_doctor_under_srun_checks_that_every_node_sees_the_run_directory(tmp_path):
    result = subprocess.run(
        [
            "srun",
            "--nodes=2",
            "--ntasks-per-node=1",
            "--time=2",
            f"--chdir={tmp_path}",
            sys.executable,
            "-m",
            "qgtrain",
            "doctor",
            "--set",
            f"logging.runs_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert "qgtrain doctor on node1 (rank 0 of 2)" in result.stdout, result.stderr
    assert f"ok       shared filesystem  all 2 node(s) see {tmp_path}" in result.stdout
    assert result.stdout.count("qgtrain doctor on") == 1, "only rank 0 prints"


def test_a_node_cut_off_mid_run_stops_every_rank_within_the_bound_and_the_next_start_resumes(
    tmp_path,
):
    """node2's link to the cluster's bridge goes down mid-run: each rank's collective times out
    after train.collective_timeout_s and names the rank that did not arrive; the next job resumes.
    The cut may land in a checkpoint save (one every 100 steps of a few milliseconds): the saver's
    collectives are bounded by the same timeout (gloo's own default is half an hour)."""
    bounded = tmp_path / "timeout.yaml"
    bounded.write_text("train: {collective_timeout_s: 20}\n")
    configs = [
        ROOT / "config.yaml",
        ROOT / "jobs" / "cpu.yaml",
        overlay(tmp_path, LONG, every_steps=100),
        points_task(tmp_path),
        bounded,
    ]
    job_id = sbatch(tmp_path, *TWO_NODES, "--time=10", "--no-requeue", configs=configs)
    run = tmp_path / "runs" / "cpu"
    wait_until(
        lambda: logged_step(run) >= 150, 180, "training to pass step 150 (a checkpoint at 100)"
    )
    subprocess.run(["ip", "link", "set", "veth-qg2", "down"], check=True)
    cut = time.time()
    try:
        # the event; the bound is checked below on the ranks' own clocks
        for rank, other in ((0, 1), (1, 0)):
            wait_until(
                lambda: f"rank(s) [{other}] did not arrive" in rank_log(run, rank),
                600,
                f"rank {rank} to name rank {other}",
            )
    finally:
        subprocess.run(["ip", "link", "set", "veth-qg2", "up"], check=True)
    for rank, other in ((0, 1), (1, 0)):
        (line,) = [
            line
            for line in rank_log(run, rank).splitlines()
            if f"rank(s) [{other}] did not arrive" in line
        ]
        named = time.mktime(time.strptime(line[:19], "%Y-%m-%d %H:%M:%S"))
        assert named - cut <= 20 + 30, (
            f"rank {rank} named rank {other} {named - cut:.0f} s after the cut: the "
            "collective timeout (20 s) and a few seconds to find who is missing"
        )
    # The failed step is retried in the allocation (a new step, on a port of its own): once the link
    # is back it resumes and completes; if the link was still down when it started, the next job
    # resumes instead.
    if wait_finished(job_id, timeout=600) != "COMPLETED":
        again = sbatch(tmp_path, *TWO_NODES, "--time=10", configs=configs)
        assert wait_finished(again) == "COMPLETED"
    assert f"resumed from {run / 'checkpoints'}" in rank_log(run, 0) and logged_step(run) == LONG


FSDP_STEPS = 300  # of the points task: seconds left after the signal at step 50


def fsdp_configs(tmp: Path, max_steps: int = FSDP_STEPS) -> list[Path]:
    """The two-node run (tests/tasks.py's points: what Slurm does with a sharded run does not
    depend on the model, and test_fsdp.py shards the built-in LM) with its Linear layers sharded."""
    sharded = tmp / "fsdp.yaml"
    # a longer run than the checkpoint's says how its learning rate goes on: from where it is
    # (rewarm 0)
    extended = "optim: {rewarm_steps: 0}\n" if max_steps != FSDP_STEPS else ""
    sharded.write_text(f"train: {{parallel: fsdp, shard_modules: [Linear]}}\n{extended}")
    return [
        ROOT / "config.yaml",
        ROOT / "jobs" / "cpu.yaml",
        overlay(tmp, max_steps, every_steps=FSDP_STEPS),
        points_task(tmp),
        sharded,
    ]


def test_an_fsdp_job_is_preempted_requeued_resumed_exactly_and_then_resumed_on_one_node(tmp_path):
    """Two nodes shard the model; the warning signal stops them at a sharded checkpoint, the
    requeued job resumes bit for bit (against an uninterrupted job trained beside it), and a later
    one-node job continues the run."""
    reference, run = tmp_path / "reference", tmp_path / "runs" / "cpu"
    reference_job, job_id = signalled_beside_reference(tmp_path, fsdp_configs, run, 180)
    assert wait_finished(job_id) == "COMPLETED"
    assert wait_finished(reference_job) == "COMPLETED", "the uninterrupted job, trained beside it"
    assert job(job_id)["Restarts"] == "1"
    log = rank_log(run, 0)
    stopped = int(log.split("stopping at step ")[1].split(" ")[0])
    assert "fsdp: sharding 2 Linear blocks and the root over 2 ranks" in log
    assert f"resumed from {run / 'checkpoints' / f'step-{stopped}'}: step {stopped}" in log
    assert (run / "checkpoints" / f"step-{FSDP_STEPS}" / "sharded" / "__1_0.distcp").is_file()
    want, have = (
        checkpoint_state(reference / "runs" / "cpu" / "checkpoints" / f"step-{FSDP_STEPS}"),
        checkpoint_state(run / "checkpoints" / f"step-{FSDP_STEPS}"),
    )
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want), (
        "final weights differ"
    )

    one_node = sbatch(
        tmp_path,
        "--nodes=1",
        "--ntasks-per-node=1",
        "--cpus-per-task=1",
        "--time=10",
        configs=fsdp_configs(tmp_path, FSDP_STEPS + 50),
    )
    assert wait_finished(one_node) == "COMPLETED"
    log = rank_log(run, 0)
    assert "resuming a 2-rank checkpoint on 1 ranks" in log and logged_step(run) == FSDP_STEPS + 50


SWEEP_STEPS = 600  # of the points task on one rank: seconds left after the signal at step 100


def test_a_sweep_runs_as_one_job_array_and_a_preempted_task_requeues_on_its_own(tmp_path):
    """Four combinations, two at a time on the two nodes; task 1 gets the warning signal mid-run,
    saves, is requeued alone and resumes; every task ends with its own settings in its own run
    directory."""
    configs = [
        ROOT / "config.yaml",
        ROOT / "jobs" / "cpu.yaml",
        overlay(tmp_path, SWEEP_STEPS, every_steps=100),
        points_task(tmp_path),
    ]
    submitted = subprocess.run(
        [
            sys.executable,
            "-m",
            "qgtrain",
            "submit",
            *[arg for c in configs for arg in ("--config", str(c))],
            "--sweep",
            "optim.lr=1e-3,3e-3",
            "--sweep",
            "train.seed=1,2",
            "--max-parallel",
            "2",
            "--set",
            "slurm.nodes=1",
            "slurm.cpus_per_task=1",
            "slurm.tasks_per_node=1",
            "slurm.time=10",
            "train.run_name=sweep",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert submitted.returncode == 0, submitted.stderr
    array = submitted.stdout.split("submitted job array ")[1].split()[0]
    runs = tmp_path / "runs"
    names = [
        "sweep-lr_1e-3-seed_1",
        "sweep-lr_1e-3-seed_2",
        "sweep-lr_3e-3-seed_1",
        "sweep-lr_3e-3-seed_2",
    ]
    wait_until(lambda: logged_step(runs / names[1]) >= 100, 180, "task 1 to pass step 100")
    running = [name for name in names if (runs / name / "metrics.jsonl").exists()]
    assert len(running) <= 2, "at most two tasks at once"
    # To the training step only: scancel retries a job-level signal while the job is being requeued
    # (it answers "try again later"), which would deliver it a second time to the next allocation.
    subprocess.run(["scancel", "--signal=USR2", f"{array}_1.0"], check=True)
    for task in range(4):
        assert wait_finished(f"{array}_{task}", timeout=600) == "COMPLETED", task
    assert job(f"{array}_1")["Restarts"] == "1" and job(f"{array}_0")["Restarts"] == "0"
    log = rank_log(runs / names[1], 0)
    stopped = int(log.split("stopping at step ")[1].split(" ")[0])
    assert (
        f"resumed from {runs / names[1] / 'checkpoints' / f'step-{stopped}'}: step {stopped}" in log
    )
    for name, (lr, seed) in zip(names, [(1e-3, 1), (1e-3, 2), (3e-3, 1), (3e-3, 2)]):
        saved = (runs / name / "config.yaml").read_text()
        assert (
            f"lr: {lr}" in saved
            and f"seed: {seed}" in saved
            and logged_step(runs / name) == SWEEP_STEPS
        )
    table = subprocess.run(
        [sys.executable, "-m", "qgtrain", "runs", str(runs)], capture_output=True, text=True
    )
    assert "optim.lr=3e-3 train.seed=2" in table.stdout and table.stdout.count("finished") == 4, (
        table.stdout
    )


def test_a_sweep_from_python_with_submitit_gives_each_task_its_run_and_result(tmp_path):
    base = qgtrain.load_config(
        [overlay(tmp_path, 60), points_task(tmp_path)],
        ["slurm.nodes=1", "slurm.cpus_per_task=1", "train.run_name=py", "train.device=cpu"],
    )
    jobs = qgtrain.submit_sweep(base, {"optim.lr": [1e-3, 3e-3]}, max_parallel=2)
    assert len(jobs) == 2 and len({job.job_id.split("_")[0] for job in jobs}) == 1, "one job array"
    runs = tmp_path / "runs"
    results = [job.result(timeout=300) for job in jobs]
    assert results == [
        {"run_dir": str(runs / name), "exit_code": 0} for name in ("py-lr_0.001", "py-lr_0.003")
    ]
    for name, lr in (("py-lr_0.001", "0.001"), ("py-lr_0.003", "0.003")):
        assert (
            f"lr: {lr}" in (runs / name / "config.yaml").read_text()
            and logged_step(runs / name) == 60
        )
    listed = json.loads((runs / ".sweeps" / "py" / "sweep.json").read_text())
    assert [run["values"] for run in listed["runs"]] == [
        {"optim.lr": "0.001"},
        {"optim.lr": "0.003"},
    ]
