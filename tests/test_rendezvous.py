"""Rendezvous from the environment. Runs against: environment tables (dict in, DistEnv out), among
them the exact variables srun, torchrun and enroot's container hook set. The nodelist table
(tests/helpers.py) is also checked against the real `scontrol show hostnames` of the Slurm test
cluster, in test_slurm_tools.py."""

from __future__ import annotations

import pytest
import torch

from qgtrain.foundation.errors import RendezvousError
from qgtrain.runtime.distributed import ddp_device_ids
from qgtrain.runtime.rendezvous import from_environ
from qgtrain.runtime.slurm_values import (
    PORT_BASE,
    PORT_SPAN,
    expand_nodelist,
    port_for_job,
    tasks_per_node,
)
from tests.helpers import NODELISTS


def slurm_step(**overrides: str) -> dict[str, str]:
    """The variables srun gives task 1 of a 2-node, 2-task step (as seen on the test cluster)."""
    env = {
        "SLURM_JOB_ID": "48832491",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_NODEID": "1",
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_STEP_NODELIST": "gpu[01-02]",
        "SLURM_STEP_TASKS_PER_NODE": "1(x2)",
        "SLURMD_NODENAME": "gpu02",
        "SLURM_CPUS_PER_TASK": "4",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v != ""}


@pytest.mark.parametrize("nodelist, hosts", NODELISTS)
def test_nodelist_expands_like_scontrol(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


def test_no_launcher_means_one_process():
    env = from_environ({}, hostname="laptop")
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.node_name) == (
        "single",
        0,
        1,
        0,
        "laptop",
    )
    assert env.job_id is None and not env.in_slurm_job


def test_slurm_step_gives_ranks_master_and_port():
    env = from_environ(slurm_step())
    assert (
        env.launcher,
        env.rank,
        env.local_rank,
        env.world_size,
        env.node_rank,
        env.num_nodes,
    ) == ("slurm", 1, 0, 2, 1, 2)
    assert (env.master_addr, env.node_name, env.cpus_per_task) == ("gpu01", "gpu02", 4)
    assert env.master_port == port_for_job("48832491", 0) and env.restart_count == 0


def test_master_address_is_the_first_host_in_any_hostlist_form():
    for nodelist, hosts in NODELISTS:
        env = from_environ(
            slurm_step(
                SLURM_JOB_NODELIST=nodelist,
                SLURM_STEP_NODELIST=nodelist,
                SLURM_STEP_TASKS_PER_NODE=f"1(x{len(hosts)})",
                SLURM_NTASKS=str(len(hosts)),
                SLURM_STEP_NUM_TASKS=str(len(hosts)),
                SLURM_PROCID="0",
                SLURM_NODEID="0",
            )
        )
        assert env.master_addr == hosts[0]


def test_the_allocations_start_is_slurms_else_the_batch_scripts():
    """Where the goodput ledger's time begins: Slurm's SLURM_JOB_START_TIME where it sets it, else
    the start the batch script exports (train.slurm, sbatch.py), else none."""
    assert from_environ(slurm_step()).job_start_time is None
    batch = slurm_step(QGTRAIN_BATCH_START="1700000100")
    assert from_environ(batch).job_start_time == 1700000100.0
    both = slurm_step(SLURM_JOB_START_TIME="1700000000", QGTRAIN_BATCH_START="1700000100")
    assert from_environ(both).job_start_time == 1700000000.0
    with pytest.raises(RendezvousError, match="QGTRAIN_BATCH_START='noon' is not an integer"):
        from_environ(slurm_step(QGTRAIN_BATCH_START="noon"))


def test_environment_master_address_and_port_override_slurm():
    env = from_environ(slurm_step(MASTER_ADDR="10.0.0.5", MASTER_PORT="31111"))
    assert (env.master_addr, env.master_port) == ("10.0.0.5", 31111)


def test_torchrun_variables_win_over_slurm():
    env = from_environ(
        slurm_step(
            RANK="5",
            LOCAL_RANK="1",
            WORLD_SIZE="8",
            LOCAL_WORLD_SIZE="4",
            MASTER_ADDR="head",
            MASTER_PORT="29400",
            GROUP_RANK="1",
        )
    )
    assert (env.launcher, env.rank, env.local_rank, env.world_size, env.node_rank) == (
        "torchrun",
        5,
        1,
        8,
        1,
    )
    assert (env.master_addr, env.master_port) == ("head", 29400)
    assert env.job_id == "48832491", "the Slurm job id is still known, for requeue"


def test_ddp_gets_the_device_index_as_an_integer_never_a_device():
    ids = ddp_device_ids(torch.device("cuda", 1))
    assert ids == [1] and type(ids[0]) is int
    assert ddp_device_ids(torch.device("cpu")) is None


def test_ports_differ_for_consecutive_jobs_restarts_and_steps_and_stay_in_range():
    ports = {
        port_for_job(str(job), restart, step)
        for job in range(48830000, 48830100)
        for restart in range(8)
        for step in range(4)
    }
    assert len(ports) == 100 * 8 * 4
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)
    first = from_environ(slurm_step())
    requeued = from_environ(slurm_step(SLURM_RESTART_COUNT="1"))
    second_step = from_environ(slurm_step(SLURM_STEP_ID="1"))
    assert requeued.restart_count == 1 and second_step.step_id == 1
    assert len({first.master_port, requeued.master_port, second_step.master_port}) == 3
    assert first.port_source == "derived from Slurm job 48832491, restart 0, step 0"


def test_array_jobs_requeue_by_array_id_and_task():
    env = from_environ(slurm_step(SLURM_ARRAY_JOB_ID="1200", SLURM_ARRAY_TASK_ID="7"))
    assert env.requeue_id == "1200_7"
    assert from_environ(slurm_step()).requeue_id == "48832491"


def test_batch_shell_with_several_tasks_is_refused_with_a_hint():
    batch = {
        "SLURM_JOB_ID": "5",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NODELIST": "vm",
    }
    with pytest.raises(
        RendezvousError, match=r"not under srun, so every task would believe it is rank 0.*srun"
    ):
        from_environ(batch)
    env = from_environ({**batch, "SLURM_NTASKS": "1"})
    assert env.world_size == 1 and env.job_id == "5", "a one-task batch job trains as one process"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"SLURM_NTASKS": "4"},
            r"SLURM_NTASKS=4 does not match this step's SLURM_STEP_NUM_TASKS=2",
        ),
        (
            {"SLURM_NTASKS": "3", "SLURM_STEP_NUM_TASKS": "3"},
            r"SLURM_NTASKS=3 does not match the allocation: 2 node",
        ),
        ({"SLURM_PROCID": "2"}, r"SLURM_PROCID=2 is outside SLURM_NTASKS=2"),
        ({"SLURM_LOCALID": "1"}, r"SLURM_LOCALID=1 is outside the 1 task\(s\) on node gpu02"),
        (
            {"SLURM_JOB_NODELIST": "gpu[01-", "SLURM_STEP_NODELIST": ""},
            r"is not a valid Slurm hostlist",
        ),
        ({"SLURM_PROCID": "one"}, r"SLURM_PROCID='one' is not an integer"),
        ({"MASTER_PORT": "70000"}, r"MASTER_PORT=70000 is not a TCP port"),
    ],
)
def test_inconsistent_slurm_environments_fail_with_a_clear_message(overrides, message):
    with pytest.raises(RendezvousError, match=message):
        from_environ(slurm_step(**overrides))


def test_partial_torchrun_variables_are_refused():
    with pytest.raises(RendezvousError, match=r"RANK=0 is set but WORLD_SIZE, LOCAL_RANK is not"):
        from_environ({"RANK": "0"})


def test_task_counts_expand():
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(RendezvousError):
        tasks_per_node("2(x")
