"""A crash is not the end of the job: on the real Slurm test cluster (three nodes), a rank's process
is SIGKILLed as the OOM killer or a lost node would end it, and the shipped train.slurm brings the
run back by itself: a new srun step in the same allocation, then a requeue away from a node that
keeps failing. A failure that is the run's own is not retried. Runs against: real sbatch jobs, real
processes, the run directory's records, and the uninterrupted two-node reference run
(conftest.two_node_reference)."""

from __future__ import annotations

import json
import random
import re
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    ROOT,
    TWO_NODE_STEPS,
    TWO_NODES,
    cli,
    final_weights,
    fresh_cli,
    job,
    kill_rank,
    logged_step,
    rank_log,
    records,
    sbatch,
    two_node_configs,
    wait_finished,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]


def configs(tmp: Path, step_retries: int = 2) -> list[Path]:
    settings = tmp / "recovery.yaml"
    settings.write_text(f"slurm: {{step_retries: {step_retries}}}\n")
    return [*two_node_configs(tmp), settings]


def failures(run: Path) -> list[dict[str, object]]:
    return json.loads((run / "status.json").read_text()).get("failures", [])


def submitted(tmp: Path, files: list[Path]) -> str:
    """`qgtrain submit --config FILE...` from `tmp`; returns the job's id."""
    done = cli("submit", *[a for f in files for a in ("--config", str(f))], cwd=tmp)
    assert done.returncode == 0, done.stderr
    return re.findall(r"job (\d+)", done.stdout)[0]


def test_a_rank_killed_in_a_job_with_a_spare_node_trains_again_on_the_spare_at_once(
    tmp_path, two_node_reference
):
    """slurm.nodes 2 and slurm.spare_nodes 1: `qgtrain submit` asks for all three nodes, each step
    runs on two. A rank killed at a random step leaves its node out of the next step, which runs
    on the other two at once (no requeue, no wait in the queue), resumes from the newest step every
    rank can restore, most often of the node-local tier (local saves every 10 steps between shared
    ones every 100; each node's folder its own, $SLURMD_NODENAME), the spare receiving the parts it
    lacks from the nodes that kept them, and ends as the uninterrupted run. The run's time adds up
    to the allocation's, until its last write."""
    chance = random.Random()
    # The kill follows the first report (every 50 steps) at or past `at` (150, 250 or 350), as
    # soon as the test sees it: most often before the next shared save, where the local tier's is
    # the newer.
    rank, at = chance.choice((0, 1)), 100 * chance.randint(1, 3) + chance.randint(1, 50)
    settings = tmp_path / "spare.yaml"
    settings.write_text(
        "slurm: {nodes: 2, spare_nodes: 1, tasks_per_node: 1, cpus_per_task: 1, time: '10'}\n"
        f"checkpoint: {{local_dir: '{tmp_path}/disk/$SLURMD_NODENAME', local_every_steps: 10}}\n"
    )
    job_id = submitted(tmp_path, [*configs(tmp_path), settings])
    run = tmp_path / "runs" / "cpu"
    wait_until(lambda: logged_step(run) >= at, 240, f"training to pass step {at}")
    killed = time.time()
    kill_rank(job_id, rank)
    assert wait_finished(job_id, timeout=600) == "COMPLETED", (rank, at)
    shown = job(job_id)
    assert shown["Restarts"] == "0" and shown["NodeList"] == "node[1-3]", shown
    lost = f"node{rank + 1}"
    (failure,) = failures(run)
    assert (failure["node"], failure["rank"], failure["how"], failure["action"]) == (
        lost,
        rank,
        "Killed",
        f"retry {lost}",
    ), (rank, at)
    assert failure["last_line"], "the killed rank's last log line"
    # each rank's node, start by start
    nodes = [re.findall(r"rank \d+ on node (\S+) ", rank_log(run, r)) for r in (0, 1)]
    assert [n[0] for n in nodes] == ["node1", "node2"]
    assert [n[1] for n in nodes] == sorted({"node1", "node2", "node3"} - {lost}), (rank, at)
    log = rank_log(run, 0)
    resumed_from = re.search(r"resumed from (\S+): step (\d+), epoch \d+( \(node-local tier)?", log)
    assert resumed_from and int(resumed_from[2]) >= at // 10 * 10, log
    # A step both tiers hold (every 100th) is resumed from the shared tier: the kill can land
    # just past one while the next local save is torn (its replica half-sent), as it did on CI.
    if int(resumed_from[2]) % 100:
        assert resumed_from[3] and resumed_from[1].startswith(f"{tmp_path}/disk/{nodes[0][1]}/")
    else:
        assert resumed_from[1] == str(run / "checkpoints" / f"step-{resumed_from[2]}"), log
    ports = re.findall(r"rendezvous node\d:(\d+)", log)
    assert len(ports) == 2 and ports[0] != ports[1], "each srun step has its own port"
    (resumed_line,) = [line for line in log.splitlines() if "resumed from" in line]
    back = time.mktime(time.strptime(resumed_line[:19], "%Y-%m-%d %H:%M:%S"))
    # the README's recovery figure (pytest -n 0 -s)
    print(f"kill to training again: {back - killed:.0f} s")
    resumed = final_weights(run, TWO_NODE_STEPS)
    assert all(torch.equal(two_node_reference[k], resumed[k]) for k in two_node_reference), (
        f"final weights differ (rank {rank} killed after step {at})"
    )
    spent = json.loads((run / "status.json").read_text())["time"]
    assert spent["starts"] == 2 and spent["reached"] == TWO_NODE_STEPS, spent
    began, ended = (
        time.mktime(time.strptime(shown[key], "%Y-%m-%dT%H:%M:%S"))
        for key in ("StartTime", "EndTime")
    )
    total = sum(spent["seconds"].values())
    print(f"goodput ledger {total:.1f} s, allocation {ended - began:.0f} s")
    # The ledger covers the allocation until its last write: what comes after it (the ranks' exit,
    # the batch script's end) is the allocation's but no start's. It counts from the allocation's
    # start where Slurm gives SLURM_JOB_START_TIME; this cluster's Slurm does not, so from the
    # start the batch script exports, which slurmd runs moments after the allocation's start.
    # Slurm's clock and the script's `date +%s` have whole seconds.
    lag = (spent["written"] - began) - total
    print(f"the ledger's lag behind the allocation: {lag:.2f} s")
    assert -1.0 <= lag <= 3.0, (lag, spent)
    assert spent["written"] <= ended + 1.0, (spent, shown["EndTime"])


FEWER_STEPS = 300


def fewer_configs(tmp: Path) -> list[Path]:
    """The two-node configs, shorter, and without dropout: a run on another world size draws its
    dropout masks from streams seeded again, so only a model without them can follow the
    uninterrupted run's losses closely."""
    settings = tmp / "fewer.yaml"
    settings.write_text(
        f"task: {{options: {{size: 2048, dropout: 0.0}}}}\ntrain: {{max_steps: {FEWER_STEPS}}}\n"
        "slurm: {nodes: 2, min_nodes: 1, tasks_per_node: 1, cpus_per_task: 1, time: '10'}\n"
    )
    return [*configs(tmp), settings]


def test_a_rank_killed_with_no_spare_goes_on_with_fewer_nodes_and_the_same_global_batch(tmp_path):
    """slurm.nodes 2, slurm.min_nodes 1, no spare: a rank SIGKILLed at a random step (by itself,
    between a report and the next save: this run is too fast for a kill from outside to land
    there) leaves its node out, and the next step of the same allocation trains on the one node
    left (no requeue), from the last shared checkpoint of two ranks, with two micro-batches a step
    where each rank took one: every step takes the same samples as the uninterrupted run of two
    ranks (here on the third node, beside it), whose losses it follows within 1e-3 (one rank's sum
    over two micro-batches for an all-reduce over two ranks) to the same data position. Its
    recomputed steps are counted."""
    chance = random.Random()
    # after the report (every 50 steps) at step 150 or 250 and before the next save (every 100),
    # so that steps are lost and trained again
    rank, at = chance.choice((0, 1)), 100 * chance.randint(1, 2) + chance.randint(51, 99)
    reference = tmp_path / "reference"
    reference.mkdir()
    uninterrupted = sbatch(
        reference, "--nodes=1", "--ntasks-per-node=2", "--time=10", configs=fewer_configs(reference)
    )
    killed = tmp_path / "killed.yaml"
    killed.write_text(
        f"task: {{factory: '{ROOT / 'tests' / 'tasks.py'}:killed_at_a_step', "
        f"options: {{size: 2048, dropout: 0.0, kill_rank: {rank}, kill_step: {at}}}}}\n"
    )
    job_id = submitted(tmp_path, [*fewer_configs(tmp_path), killed])
    run = tmp_path / "runs" / "cpu"
    assert wait_finished(job_id, timeout=600) == "COMPLETED", (rank, at)
    lost = re.findall(r"rank \d+ on node (\S+) ", rank_log(run, rank))[0]
    assert job(job_id)["Restarts"] == "0"
    (failure,) = failures(run)
    assert (failure["node"], failure["action"]) == (lost, f"retry {lost} 1"), (rank, at)
    log = rank_log(run, 0)
    starts = re.findall(r"(\d+) rank\(s\) on (\d+) node\(s\)", log)
    assert starts == [("2", "2"), ("1", "1")], starts
    assert re.findall(r"rank 0 on node (\S+) ", log)[1] != lost
    assert (
        "1 rank(s), fewer than slurm.nodes' 2 (slurm.min_nodes): 2 micro-batches a step keep the "
        "global batch" in log
    )
    resumed = int(re.findall(r"resumed from \S+/step-(\d+): step", log)[0])
    assert resumed == at // 100 * 100 and "resuming a 2-rank checkpoint on 1 ranks" in log, log
    assert wait_finished(uninterrupted, timeout=600) == "COMPLETED"
    expected = {r["step"]: r for r in records(reference / "runs" / "cpu") if "loss" in r}
    # the steps both logged (a start logs its first step too)
    after = [r for r in records(run) if r["step"] > resumed and r["step"] in expected]
    assert after and after[-1]["step"] == FEWER_STEPS
    gaps = [abs(r["loss"] / expected[r["step"]]["loss"] - 1) for r in after]
    print(f"losses on one node: at most {max(gaps):.1e} from the two-rank run's")
    for record in after:
        assert record["loss"] == pytest.approx(expected[record["step"]]["loss"], rel=1e-3), (
            record["step"],
            rank,
            at,
        )
    last = f"runs/cpu/checkpoints/step-{FEWER_STEPS}/state.json"
    position = [
        {
            k: json.loads((folder / last).read_text())["trainer"][k]
            for k in ("epoch", "samples_in_epoch")
        }
        for folder in (tmp_path, reference)
    ]
    assert position[0] == position[1], "every sample seen once, to the same position"
    spent = json.loads((run / "status.json").read_text())["time"]
    assert spent["starts"] == 2 and spent["seconds"]["recomputed"] > 0, spent


LOCAL_STEPS = 200


def test_an_fsdp_job_killed_after_a_damaged_local_save_retries_from_the_next_good_copy(tmp_path):
    """fsdp on two nodes, each with a local folder of its own (node-local saves every 10 steps in
    the background, each kept on the other node too; shared ones every 100). Rank 0's part of the
    newest local step is damaged on both nodes, as a failing disk leaves it, and a rank SIGKILLs
    itself a few steps later. The retry in the same allocation names each damaged copy once,
    resumes from the local step before it (the start does not loop on the bad one) and trains the
    steps since again to the losses the first start logged, bit for bit, to the end."""
    chance = random.Random()
    # the damaged step 20-90 past the shared save at 100, so that the local one before it is the
    # newest
    damaged = 100 + 10 * chance.randint(2, 9)
    rank, at = chance.choice((0, 1)), damaged + chance.randint(2, 5)
    run, settings = tmp_path / "runs" / "cpu", tmp_path / "local.yaml"
    settings.write_text(
        f"task: {{factory: '{ROOT / 'tests' / 'tasks.py'}:killed_at_a_step', options: "
        f"{{size: 2048, kill_rank: {rank}, kill_step: {at}, damage: '{tmp_path}/disk', "
        f"keep_metrics: '{run}/metrics.jsonl'}}}}\n"
        f"train: {{max_steps: {LOCAL_STEPS}, log_every: 1, parallel: fsdp, "
        "shard_modules: [Linear]}\n"
        "slurm: {nodes: 2, tasks_per_node: 1, cpus_per_task: 1, time: '10'}\n"
        f"checkpoint: {{local_dir: '{tmp_path}/disk/$SLURMD_NODENAME', local_every_steps: 10, "
        "async_save: true}\n"
    )
    job_id = submitted(tmp_path, [*configs(tmp_path), settings])
    assert wait_finished(job_id, timeout=600) == "COMPLETED", (rank, at)
    assert job(job_id)["Restarts"] == "0"
    (failure,) = failures(run)
    assert failure["rank"] == rank and failure["action"].startswith("retry"), failure
    logs = rank_log(run, 0) + rank_log(run, 1)
    passed_over = r"passing over a node-local checkpoint file: (\S+) fails its checksum"
    named = sorted(re.sub(r"qgtrain-\w+", "qgtrain-*", f) for f in re.findall(passed_over, logs))
    # each node's copy once (rotation has since removed the step)
    assert named == [f"{tmp_path}/disk/node{n}/qgtrain-*/step-{damaged}/rank-0.pt" for n in (1, 2)]
    resumed = damaged - 10
    assert re.search(
        rf"resumed from {tmp_path}/disk/node\d/qgtrain-\w+/step-{resumed}: step {resumed}, "
        r"epoch \d+ \(node-local tier",
        logs,
    ), logs
    # the first start's records, kept by the killed rank: this start cut metrics.jsonl back
    first = {r["step"]: r["loss"] for r in records(run, "first.jsonl") if "loss" in r}
    last = {r["step"]: r["loss"] for r in records(run) if "loss" in r}
    again = {step: last[step] for step in range(resumed + 1, at)}
    assert again == {step: first[step] for step in again}, (rank, at)
    assert max(last) == LOCAL_STEPS


def test_the_runs_own_failure_is_not_retried(tmp_path):
    settings = tmp_path / "task.yaml"
    settings.write_text(
        f"task: {{factory: '{ROOT / 'tests' / 'tasks.py'}:raises_on_rank_one', "
        "options: {where: loss}}\n"
    )
    job_id = sbatch(tmp_path, *TWO_NODES, "--time=10", configs=[*configs(tmp_path), settings])
    run = tmp_path / "runs" / "cpu"
    assert wait_finished(job_id, timeout=300) == "FAILED"
    (failure,) = failures(run)
    assert failure["action"] == "end" and "sample 17 has no label" in str(failure["reason"])
    assert rank_log(run, 0).count("rendezvous node1:") == 1, "one step: no retry"
    assert json.loads((run / "status.json").read_text())["status"] == "failed"


def test_a_node_that_fails_twice_is_kept_away_from_when_the_job_is_requeued(
    tmp_path, two_node_reference
):
    """One retry in the allocation; the second failure on node2 requeues the job with node2
    excluded, and the new allocation (node1 and node3) finishes the run."""
    job_id = sbatch(
        tmp_path,
        "--nodes=2",
        "--ntasks-per-node=1",
        "--cpus-per-task=1",
        "--time=10",
        configs=configs(tmp_path, step_retries=1),
    )
    run = tmp_path / "runs" / "cpu"
    for attempt in (1, 2):
        # The resume is logged after the metrics of the attempt before are cut back to its
        # checkpoint.
        wait_until(
            lambda: (
                rank_log(run, 0).count("rendezvous node1:") == attempt
                and rank_log(run, 0).count("resumed from") == attempt - 1
                and logged_step(run) >= 150
            ),
            300,
            f"attempt {attempt} to train past step 150",
        )
        assert job(job_id)["NodeList"] == "node[1-2]"
        kill_rank(job_id, 1)
    assert wait_finished(job_id, timeout=600) == "COMPLETED"
    shown = job(job_id)
    assert (
        shown["Restarts"] == "1"
        and shown["ExcNodeList"] == "node2"
        and shown["NodeList"] == "node[1,3]"
    )
    assert [f["action"] for f in failures(run)] == ["retry", "requeue node2"]
    resumed = final_weights(run, TWO_NODE_STEPS)
    assert all(torch.equal(two_node_reference[k], resumed[k]) for k in two_node_reference), (
        "final weights differ"
    )


def test_a_submitit_job_whose_rank_is_killed_is_retried_in_its_allocation(
    tmp_path, two_node_reference
):
    """submitit's script runs its srun line through the same retry loop as train.slurm (a shell
    function of the setup lines), so the failed step comes back in the allocation and the job's
    result is the run's."""
    import qgtrain

    submitted = qgtrain.submit(
        configs(tmp_path)[2],
        folder=tmp_path / "submitit",
        slurm__nodes=2,
        slurm__cpus_per_task=1,
        train__run_name="submitit",
        train__device="cpu",
        train__precision="fp32",
        task__factory=f"{ROOT / 'tests' / 'tasks.py'}:points",  # as two_node_configs
        task__options={"size": 2048},
    )
    run = tmp_path / "runs" / "submitit"
    wait_until(
        lambda: logged_step(run) >= 150, 180, "training to pass step 150 (a checkpoint at 100)"
    )
    kill_rank(submitted.job_id, 1)
    assert submitted.result(timeout=600) == {"run_dir": str(run), "exit_code": 0}
    assert job(submitted.job_id)["Restarts"] == "0"
    (failure,) = failures(run)
    assert (failure["rank"], failure["how"], failure["action"]) == (1, "Killed", "retry")
    resumed = final_weights(run, TWO_NODE_STEPS)
    assert all(torch.equal(two_node_reference[k], resumed[k]) for k in two_node_reference), (
        "final weights differ"
    )


def test_an_exclude_that_leaves_too_few_nodes_is_refused_before_sbatch(tmp_path):
    done = fresh_cli(
        "submit",
        "--config",
        str(ROOT / "config.yaml"),
        "--set",
        "slurm.nodes=2",
        "slurm.extra_sbatch=['--exclude=node[2-3]']",
        f"logging.runs_dir={tmp_path / 'runs'}",
        cwd=tmp_path,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert (
        "slurm.extra_sbatch: --exclude=node[2-3] leaves 1 of the 3 usable nodes of the default "
        "partition, and "
        "the job asks for slurm.nodes=2" in done.stderr
    )
    assert not (tmp_path / "runs").exists(), "nothing submitted, nothing written"
