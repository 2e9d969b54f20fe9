"""The node-local checkpoint tier. Runs against: real `qgtrain train` ranks on gloo laid out as two
nodes (torchrun's LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK), each node with a local folder of its
own, SIGKILLed once a local step is complete on both nodes, then resumed, and compared with an
uninterrupted run bit for bit; and the
plan every rank works out from what the ranks hold (local_tier.choose), as a table."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from qgtrain.state.cadence import LocalCadence
from qgtrain.state.local_files import LocalFolder
from qgtrain.state.local_tier import RestorePlan, Transfer, choose
from tests.helpers import ROOT, assert_resumed_equals, cli, rank_log, wait_for
from tests.ranks import kill_ranks, start_cli_ranks, wait_ranks

STEPS, SHARED_EVERY, LOCAL_EVERY = 24, 12, 2
LAYOUTS = {  # ranks per node for each strategy: hsdp shards within a node, replicates across two
    "ddp": 1,
    "fsdp": 1,
    "hsdp": 2,
}


def on_nodes(parallel: str) -> Callable[[int], dict[str, str]]:
    """Each rank's place: two nodes, LAYOUTS[parallel] ranks on each."""
    per_node = LAYOUTS[parallel]
    return lambda rank: {
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(rank // per_node),
    }


def settings(tmp: Path, parallel: str) -> list[str]:
    return [
        "train",
        "--set",
        f"task.factory={ROOT / 'tests' / 'tasks.py'}:slow_evaluation",
        "task.options={size: 512, step_s: 0.05}",
        f"train.max_steps={STEPS}",
        "train.log_every=1",
        "train.eval_every=0",
        f"train.parallel={parallel}",
        *(["train.shard_modules=[Linear]"] if parallel != "ddp" else []),
        f"checkpoint.every_steps={SHARED_EVERY}",
        f"checkpoint.local_every_steps={LOCAL_EVERY}",
        f"checkpoint.local_dir={tmp}/node$GROUP_RANK",  # each node its own disk
        # fsdp's saves, both tiers, in the background after a host copy
        f"checkpoint.async_save={str(parallel == 'fsdp').lower()}",
        "logging.tensorboard=false",
        "--run-dir",
        str(tmp / "run"),
    ]


def start(tmp: Path, parallel: str, log_prefix: str = "rank") -> list[Any]:
    ranks = 2 * LAYOUTS[parallel]
    return start_cli_ranks(
        ranks, settings(tmp, parallel), tmp, env=on_nodes(parallel), log_prefix=log_prefix
    )


def node_step(tmp: Path, node: int, step: int) -> Path:
    return next((tmp / f"node{node}").glob("qgtrain-*"), tmp / "none") / f"step-{step}"


def complete(tmp: Path, step: int, ranks: int = 2) -> bool:
    """Every rank's part of `step` written, and each kept on the other node."""
    return all(
        (node_step(tmp, node, step) / f"rank-{rank}.json").exists()
        for node in (0, 1)
        for rank in range(ranks)
    )


def killed_after_a_local_save(tmp: Path, parallel: str) -> int:
    """Train until step 16 is saved locally on both nodes (the shared tier holds step 12), SIGKILL
    every rank; returns the newest step complete on both nodes."""
    procs, ranks = start(tmp, parallel), 2 * LAYOUTS[parallel]
    wait_for(lambda: complete(tmp, 16, ranks), procs, "step 16 saved on both nodes", 180)
    kill_ranks(procs)
    return max(s for s in range(16, STEPS, LOCAL_EVERY) if complete(tmp, s, ranks))


def resume(tmp: Path, parallel: str) -> str:
    """Every rank's log of the start that resumes."""
    procs = start(tmp, parallel, log_prefix="resumed")
    assert wait_ranks(procs, 300) == [0] * len(procs)
    return "".join(rank_log(tmp / "run", rank) for rank in range(len(procs)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def run_for(parallel: str) -> Path:
        if parallel not in made:
            tmp = tmp_path_factory.mktemp(f"uninterrupted-{parallel}")
            procs = start(tmp, parallel)
            assert wait_ranks(procs, 300) == [0] * len(procs)
            made[parallel] = tmp / "run"
        return made[parallel]

    return run_for


@pytest.mark.parametrize("parallel", ["ddp", "fsdp", "hsdp"])
def test_a_job_killed_after_a_local_save_resumes_from_it_bit_for_bit(
    tmp_path, uninterrupted, parallel
):
    step = killed_after_a_local_save(tmp_path, parallel)
    log = resume(tmp_path, parallel)
    assert re.search(rf"step-{step}: step {step}, epoch \d+ \(node-local tier\)", log), log
    assert_resumed_equals(uninterrupted(parallel), tmp_path / "run", parallel, STEPS)
    runs = cli("runs", str(tmp_path / "run"), cwd=tmp_path)
    assert f"run: last resumed at step {step} from the node-local tier" in runs.stdout


def test_a_node_whose_local_disk_is_lost_resumes_from_its_neighbours_copy(tmp_path, uninterrupted):
    step = killed_after_a_local_save(tmp_path, "ddp")
    for folder in (tmp_path / "node1").iterdir():  # the node's disk, gone with the node
        folder.rename(tmp_path / "lost")
    log = resume(tmp_path, "ddp")
    assert f"step-{step}: step {step}, epoch 0 (node-local tier; rank-1, whole from another " in log
    assert_resumed_equals(uninterrupted("ddp"), tmp_path / "run", "node 1 lost", STEPS)


def test_damaged_copies_are_passed_over_with_a_line_each_for_the_next_good_one(
    tmp_path, uninterrupted
):
    """Rank 0's part of the newest step damaged on its node and on the next: the step before it
    (rotation removes a step only once a newer one is complete everywhere). Each copy is named once
    and never chosen, so the start does not loop on it."""
    step = killed_after_a_local_save(tmp_path, "ddp")
    for node in (0, 1):
        part = node_step(tmp_path, node, step) / "rank-0.pt"
        data = bytearray(part.read_bytes())
        data[len(data) // 2] ^= 0xFF
        part.write_bytes(bytes(data))
    log = resume(tmp_path, "ddp")
    assert f"step-{step - LOCAL_EVERY}: step {step - LOCAL_EVERY}, epoch 0 (node-local tier" in log
    passed_over = r"passing over a node-local checkpoint file: (\S+) fails its checksum"
    damaged = [str(node_step(tmp_path, node, step) / "rank-0.pt") for node in (0, 1)]
    assert sorted(re.findall(passed_over, log)) == sorted(damaged)
    assert_resumed_equals(uninterrupted("ddp"), tmp_path / "run", "damaged copies", STEPS)


def holding(node: int, local_rank: int, holds: dict[int, list[str]]) -> dict[str, object]:
    return {"node": node, "local_rank": local_rank, "holds": holds}


TWO_BY_TWO = [  # ranks 0, 1 on node 0; 2, 3 on node 1: rank r keeps the replica of r - 2 (mod 4)
    holding(0, 0, {8: ["rank-0", "rank-2", "whole"], 6: ["rank-0", "rank-2", "whole"]}),
    holding(0, 1, {8: ["rank-1", "rank-3"], 6: ["rank-1", "rank-3"]}),
    holding(1, 0, {8: ["rank-2", "rank-0", "whole"], 6: ["rank-2", "rank-0", "whole"]}),
    holding(1, 1, {8: ["rank-3", "rank-1"], 6: ["rank-3", "rank-1"]}),
]


def lost(reports: list[dict[str, object]], ranks: set[int], steps: set[int]) -> list[dict]:
    """The reports with what `ranks` held at `steps` gone."""
    return [
        {**r, "holds": {s: ([] if i in ranks and s in steps else n) for s, n in r["holds"].items()}}
        for i, r in enumerate(reports)
    ]


@pytest.mark.parametrize(
    "reports, whole, after, plan",
    [
        (TWO_BY_TWO, True, 0, RestorePlan(8, ())),
        # the shared tier is as new: nothing to take from this one
        (TWO_BY_TWO, True, 8, None),
        # node 1's disk lost: its ranks' parts from their replicas, the whole model from node 0
        (
            lost(TWO_BY_TWO, {2, 3}, {8, 6}),
            True,
            0,
            RestorePlan(
                8,
                (
                    Transfer("rank-2", 0, 2),
                    Transfer("rank-3", 1, 3),
                    Transfer("whole", 0, 2),
                    Transfer("whole", 0, 3),
                ),
            ),
        ),
        # under fsdp no whole model is needed
        (
            lost(TWO_BY_TWO, {2, 3}, {8}),
            False,
            0,
            RestorePlan(8, (Transfer("rank-2", 0, 2), Transfer("rank-3", 1, 3))),
        ),
        # rank 1's part of step 8 held nowhere (its node and its replica's both lost it): step 6
        (lost(lost(TWO_BY_TWO, {1}, {8}), {3}, {8}), True, 0, RestorePlan(6, ())),
        # nothing newer than the shared tier's step 6 is complete
        (lost(TWO_BY_TWO, {1, 3}, {8}), True, 6, None),
    ],
)
def test_every_rank_works_out_the_same_newest_step_and_who_sends_what(reports, whole, after, plan):
    assert choose(reports, 4, whole, after) == plan


def test_a_part_counts_only_for_its_own_run_and_layout_and_whole(tmp_path):
    """local_files.LocalFolder.problem: what a start passes over, each with the reason it says."""
    folder = LocalFolder(tmp_path, "run-a", "2 ranks, 1 per node, ddp")
    folder.write(8, "rank-0", {"rng": torch.arange(4)})
    assert folder.problem(8, "rank-0") is None
    other_run = LocalFolder(tmp_path, "run-b", folder.layout)
    assert "belongs to another run (run id run-a, not run-b)" in str(other_run.problem(8, "rank-0"))
    other_layout = LocalFolder(tmp_path, "run-a", "4 ranks, 2 per node, ddp")
    assert "was saved by 2 ranks, 1 per node, ddp" in str(other_layout.problem(8, "rank-0"))
    part = folder.part(8, "rank-0")
    part.write_bytes(part.read_bytes()[:-1] + b"?")
    assert str(folder.problem(8, "rank-0")).endswith("fails its checksum (damaged)")
    (tmp_path / "step-8" / "rank-0.json").unlink()
    assert "is incomplete" in str(folder.problem(8, "rank-0"))
    folder.write(10, "rank-0", {})
    folder.write(12, "rank-0", {})
    assert folder.keep_newest(2) == [folder.step(8)] and folder.steps() == [12, 10]


def test_auto_saves_by_the_clock_at_the_young_daly_interval_once_per_interval():
    """checkpoint.local_every_steps: auto: the first save at once (to measure its stall), then
    every sqrt(2 x stall x the job's MTBF); a save asked for is not asked again before it is made
    (the agreement reaches it agreements later)."""
    cadence = LocalCadence(every_steps=0, mtbf_s=100.0)
    assert cadence.due_by_clock(0.0) and not cadence.due_by_clock(1.0), "asked once"
    cadence.saved(0.5, 2.0, tell=False)  # sqrt(2 x 0.5 x 100) = 10 s
    assert [cadence.due_by_clock(now) for now in (11.0, 12.0, 12.5)] == [False, True, False]
    cadence.saved(0.5, 13.0, tell=False)
    assert not cadence.due_by_clock(22.9) and cadence.due_by_clock(23.0)
    assert not LocalCadence(every_steps=5, mtbf_s=1.0).due_by_clock(1e9), "by the step instead"
    assert [step for step in range(1, 12) if LocalCadence(5, 1.0).due(step)] == [5, 10]


def test_a_run_with_auto_saves_locally_by_the_clock_each_interval_once(tmp_path):
    """A run of sleep-paced steps whose MTBF makes the interval about a second: local saves
    spread over the run, none of them repeated at the next agreements (as a cadence asked for
    again before its save would), and the interval told once."""
    paced = tmp_path / "auto.yaml"
    paced.write_text(
        f"task: {{factory: '{ROOT / 'tests' / 'tasks.py'}:slow_evaluation', "
        "options: {size: 2048, step_s: 0.01, eval_batch_s: 0}}\n"
        "train: {max_steps: 300, log_every: 100, eval_every: 0, agree_every: 5}\n"
        f"checkpoint: {{every_steps: 0, local_dir: '{tmp_path}/local', local_every_steps: auto, "
        "gpu_mtbf_hours: 0.003, local_keep: 100}\n"
        f"logging: {{tensorboard: false, runs_dir: '{tmp_path}/runs'}}\n"
    )
    configs = [ROOT / "config.yaml", ROOT / "jobs" / "cpu.yaml", paced]
    done = cli("train", *[a for c in configs for a in ("--config", str(c))], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    told = re.findall(r"node-local tier by the clock .*: every ([\d.]+) s", done.stderr)
    assert len(told) == 1, done.stderr[-2000:]
    saved = sorted(int(p.name[5:]) for p in (tmp_path / "local").glob("qgtrain-*/step-*"))
    assert saved[0] <= 10 and len(saved) >= 3, saved
    gaps = [b - a for a, b in zip(saved, saved[1:])]
    assert min(gaps) > 5, f"a save repeated at the next agreement: {saved}"
