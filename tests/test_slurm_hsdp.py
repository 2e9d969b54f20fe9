"""HSDP on the real Slurm test cluster: two nodes with two ranks each, the model sharded within a
node and replicated across the two. Runs against: real sbatch jobs of the shipped train.slurm, a
rank SIGKILLed as a lost process would end, the step retried in the allocation, and a later one-node
job under fsdp."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    ROOT,
    checkpoint_state,
    kill_rank,
    logged_step,
    overlay,
    rank_log,
    records,
    sbatch,
    wait_finished,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]
TWO_BY_TWO = (
    "--nodes=2",
    "--ntasks-per-node=2",
    "--cpus-per-task=1",
    "--nodelist=node[1-2]",
    "--time=10",
)
STEPS = 120  # saves at 40 and 80; the kill lands after step 60, 60 steps before the end


def configs(tmp: Path, parallel: str, steps: int = STEPS) -> list[Path]:
    tmp.mkdir(exist_ok=True)
    mode = tmp / f"{parallel}.yaml"
    # a longer run than the checkpoint's says how its learning rate goes on: from where it is
    # (rewarm 0)
    extended = "optim: {rewarm_steps: 0}\n" if steps != STEPS else ""
    # tests/tasks.py's points: a model of two Linear layers and no transformers to import, which
    # would cost each of the 18 ranks' starts seconds of CPU the other tests need
    mode.write_text(
        f"task: {{factory: '{ROOT / 'tests' / 'tasks.py'}:points', options: {{size: 2048}}}}\n"
        f"train: {{parallel: {parallel}, log_every: 20, shard_modules: [Linear]}}\n"
        f"slurm: {{step_retries: 2}}\n{extended}"
    )
    return [
        ROOT / "config.yaml",
        ROOT / "jobs" / "cpu.yaml",
        overlay(tmp, steps, every_steps=40),
        mode,
    ]


def test_hsdp_trains_like_ddp_survives_a_sigkill_bit_for_bit_and_resumes_on_one_node_under_fsdp(
    tmp_path,
):
    reference, ddp = tmp_path / "reference", tmp_path / "ddp"
    # the three side by side: the uninterrupted hsdp and ddp runs, and the hsdp run to be killed
    jobs = [
        sbatch(reference, *TWO_BY_TWO, configs=configs(reference, "hsdp")),
        sbatch(ddp, *TWO_BY_TWO, configs=configs(ddp, "ddp")),
    ]
    job_id = sbatch(tmp_path, *TWO_BY_TWO, configs=configs(tmp_path, "hsdp"))
    run = tmp_path / "runs" / "cpu"
    wait_until(lambda: logged_step(run) >= 60, 300, "training to pass step 60 (a checkpoint at 40)")
    kill_rank(job_id, 3)  # on node2: its replica of the model loses a shard
    assert [wait_finished(j, timeout=600) for j in jobs] == ["COMPLETED", "COMPLETED"]
    log = rank_log(reference / "runs" / "cpu", 0)
    assert "hsdp: 2 replicas of the model, each sharded over 2 ranks (0,1; 2,3)" in log
    replicated, sharded = records(ddp / "runs" / "cpu"), records(reference / "runs" / "cpu")
    assert [r["step"] for r in sharded] == [r["step"] for r in replicated] and len(sharded) >= 6
    # the same sums in another order: fp32 rounding, nothing more
    for a, b in zip(replicated, sharded):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4), a["step"]

    assert wait_finished(job_id, timeout=600) == "COMPLETED"
    assert re.search(
        rf"resumed from {run / 'checkpoints'}/step-(40|80): step (40|80)", rank_log(run, 0)
    )
    want, have = (
        checkpoint_state(reference / "runs" / "cpu" / "checkpoints" / f"step-{STEPS}"),
        checkpoint_state(run / "checkpoints" / f"step-{STEPS}"),
    )
    assert want.keys() == have.keys() and all(torch.equal(want[k], have[k]) for k in want), (
        "final weights differ"
    )
    # the killed attempt's lines, then the resumed ones
    resumed = {r["step"]: r["loss"] for r in records(run)}
    assert all(resumed[r["step"]] == r["loss"] for r in sharded), "the resumed losses differ"

    one_node = sbatch(
        tmp_path,
        "--nodes=1",
        "--ntasks-per-node=2",
        "--cpus-per-task=1",
        "--time=10",
        configs=configs(tmp_path, "fsdp", STEPS + 40),
    )
    assert wait_finished(one_node) == "COMPLETED"
    assert (
        "resuming a 4-rank checkpoint on 2 ranks" in rank_log(run, 0)
        and logged_step(run) == STEPS + 40
    )
