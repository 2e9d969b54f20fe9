"""After a failed step in a batch job: retry in the allocation, requeue (away from a node that keeps
failing), or end on the run's own failure. Runs against: srun's real messages (as the test cluster
printed them), the decision as a table, and a run directory holding the notes failing ranks
leave."""

from __future__ import annotations

import json

import pytest

from qgtrain.config import SlurmConfig
from qgtrain.launch import aborts
from qgtrain.launch.recovery import Decision, decide, fewer_nodes, recover
from qgtrain.launch.srun_log import TaskFailure, task_failures
from qgtrain.launch.suspects import Suspect, suspect
from qgtrain.runs import rundir

RETRY_TWICE = SlurmConfig(step_retries=2, max_restarts=20)
# What srun printed on the test cluster when task 1 was SIGKILLed and the step was taken down.
KILLED = """srun: error: node2: task 1: Killed
srun: launch/slurm: _step_signal: Terminating StepId=48872078.3
slurmstepd-node1: error: *** STEP 48872078.3 ON node1 CANCELLED AT 2026-11-24T01:38:41 ***
srun: error: node1: task 0: Exited with exit code 1
srun: Force Terminated StepId=48872078.3
"""


def test_the_first_task_srun_reports_is_the_one_that_failed():
    assert task_failures(KILLED)[0] == TaskFailure("node2", 1, "Killed")
    ranged = task_failures("srun: error: gpu07: tasks 4-7: Exited with exit code 2\n")
    assert ranged[0] == TaskFailure("gpu07", 4, "Exited with exit code 2")
    assert [f.rank for f in ranged] == [4, 5, 6, 7]
    assert task_failures("step output only\n") == []


OWN = {1: {"message": "ValueError: sample 17 has no label", "retryable": False}}
MACHINE = {1: {"message": "checkpoint at step 40 failed: rank 1 cannot write", "retryable": True}}
DIED = TaskFailure("node2", 1, "Killed")


@pytest.mark.parametrize(
    "notes, failure, attempt, restart, per_node, spare, expected",
    [
        ({}, DIED, 0, 0, {"node2": 1}, 1, Decision("retry", "retry 1 of 2 in this allocation")),
        (MACHINE, None, 1, 0, {}, 1, Decision("retry", "retry 2 of 2 in this allocation")),
        (
            OWN,
            DIED,
            0,
            0,
            {"node2": 1},
            1,
            Decision(
                "end",
                "rank 1 failed on its own (ValueError: sample 17 has no label): a new attempt "
                "would fail the same way",
            ),
        ),
        (
            {},
            TaskFailure("node1", 0, "Exited with exit code 2"),
            0,
            0,
            {},
            1,
            Decision(
                "end",
                "rank 0 on node1 stopped on bad input (exit 2); its message is in the job's output",
            ),
        ),
        (
            {},
            DIED,
            2,
            0,
            {"node2": 1},
            1,
            Decision("requeue", "2 retries in this allocation failed; requeueing"),
        ),
        (
            {},
            DIED,
            2,
            0,
            {"node2": 3, "node1": 1},
            1,
            Decision(
                "requeue",
                "2 retries in this allocation failed; requeueing, away from node2, which failed "
                "twice or more",
                ("node2",),
            ),
        ),
        (
            {},
            DIED,
            2,
            0,
            {"node2": 2},
            0,
            Decision(
                "requeue",
                "2 retries in this allocation failed; requeueing (not excluding node2: the "
                "partition has no other nodes to take their place)",
            ),
        ),
        (
            {},
            DIED,
            2,
            20,
            {"node2": 1},
            1,
            Decision(
                "end",
                "2 retries in this allocation failed, and the job is not requeued "
                "(slurm.requeue=True, restart 20 of at most 20)",
            ),
        ),
    ],
)
def test_what_a_failed_step_leads_to(notes, failure, attempt, restart, per_node, spare, expected):
    assert decide(notes, failure, attempt, 2, restart, 20, True, per_node, spare) == expected


def test_each_failure_is_recorded_with_its_rank_node_how_and_last_log_line(tmp_path):
    run = rundir.RunDir(tmp_path)
    run.logs.mkdir()
    run.rank_log(1).write_text("step 10/100 loss 2.5\nstep 20/100 loss 2.1\n")
    rundir.write_status(tmp_path, "running", restart=0)
    first = recover(tmp_path, KILLED, 137, 0, 0, 2, RETRY_TWICE, 0)
    second = recover(tmp_path, KILLED, 137, 1, 0, 2, RETRY_TWICE, 0)
    third = recover(tmp_path, KILLED, 137, 2, 0, 2, RETRY_TWICE, 1)
    assert [first.line(), second.line(), third.line()] == ["retry", "retry", "requeue node2"]
    failures = json.loads(run.status.read_text())["failures"]
    assert [(f["node"], f["rank"], f["how"], f["last_line"], f["action"]) for f in failures] == [
        ("node2", 1, "Killed", "step 20/100 loss 2.1", action)
        for action in ("retry", "retry", "requeue node2")
    ]


def test_a_note_of_the_runs_own_failure_ends_the_job(tmp_path):
    run = rundir.RunDir(tmp_path)
    run.logs.mkdir()
    run.failure_note(1).write_text(json.dumps(OWN[1]))
    assert recover(tmp_path, KILLED, 143, 0, 0, 2, RETRY_TWICE, None).action == "end"


# What `sinfo -h -N -o "%N %t %P"` printed on the test cluster: node1-3 in the default partition
# (its name marked *), node4-5 in another; node2 drained.
SINFO = """node1 idle debug*
node2 drain debug*
node3 mix debug*
node4 idle side
node5 alloc side
"""


@pytest.mark.parametrize(
    "partition, usable",
    [
        ("", {"node1", "node3"}),  # a job that names no partition goes to the default one
        ("side", {"node4", "node5"}),
    ],
)
def test_the_usable_nodes_are_those_up_in_the_partition_the_job_goes_to(partition, usable):
    from subprocess import CompletedProcess

    from qgtrain.launch.nodes import usable_nodes

    def sinfo(command, **_):  # type: ignore[no-untyped-def]
        assert command[:5] == ["sinfo", "-h", "-N", "-o", "%N %t %P"]
        assert command[5:] == (["-p", partition] if partition else [])
        lines = SINFO.splitlines()
        shown = [line for line in lines if not partition or line.split()[2] == partition]
        return CompletedProcess(command, 0, "\n".join(shown) + "\n", "")

    assert usable_nodes(partition, sinfo) == usable


SUSPECT = Suspect("node2", "rank 1 on node2: Killed")


@pytest.mark.parametrize(
    "notes, failure, attempt, spares, suspect, expected",
    [
        (
            {},
            DIED,
            2,  # no retries left: a spare still takes the node's place
            1,
            SUSPECT,
            Decision(
                "retry",
                "rank 1 on node2: Killed; retrying in this allocation on a spare node, without "
                "node2 (0 spare(s) left)",
                ("node2",),
            ),
        ),
        ({}, DIED, 0, 0, SUSPECT, Decision("retry", "retry 1 of 2 in this allocation")),
        (MACHINE, None, 0, 1, None, Decision("retry", "retry 1 of 2 in this allocation")),
        (OWN, DIED, 0, 2, SUSPECT, decide(OWN, DIED, 0, 2, 0, 20, True, {}, 1)),  # the run's own
    ],
    ids=["spare", "no-spare-left", "no-node-named", "own-failure"],
)
def test_a_failure_srun_places_on_a_node_is_retried_on_a_spare(
    notes, failure, attempt, spares, suspect, expected
):
    assert decide(notes, failure, attempt, 2, 0, 20, True, {}, 1, None, spares, suspect) == expected


def _aborted(silent: tuple[int, ...]) -> aborts.Abort:
    return aborts.Abort(
        "collective", (0, 1, 2, 3), tuple(set(range(4)) - set(silent)), silent, "/r"
    )


TASKS = [
    TaskFailure("node1", 0, "Aborted"),
    TaskFailure("node1", 1, "Aborted"),
    TaskFailure("node2", 2, "Aborted"),
    TaskFailure("node2", 3, "Aborted"),
]


@pytest.mark.parametrize(
    "failures, lost, nccl, earlier, expected",
    [
        (TASKS, ["node3"], _aborted((2,)), {"node1": 1}, ("node3", "srun: Node failure on node3")),
        (
            TASKS,
            [],
            _aborted((2, 3)),
            {"node1": 1},
            ("node2", "rank(s) 2,3 on node2 left no NCCL dump"),
        ),
        (TASKS, [], _aborted((1, 2)), {}, ("node1", "rank 0 on node1: Aborted")),  # on two nodes
        (
            TASKS,
            [],
            None,
            {"node2": 1},
            ("node2", "rank 2 on node2: Aborted, a node that failed 1 time(s) before in this run"),
        ),
        (TASKS, [], None, {"node5": 2}, ("node1", "rank 0 on node1: Aborted")),
        ([], [], None, {}, None),
    ],
    ids=["lost", "silent-node", "silent-on-two", "failed-before", "first-task", "nothing"],
)
def test_a_failed_step_points_at_the_node_the_strongest_sign_names(
    failures, lost, nccl, earlier, expected
):
    found = suspect(failures, lost, nccl, earlier)
    assert (None if found is None else (found.node, found.why)) == expected


@pytest.mark.parametrize(
    "nodes, min_nodes, accumulate, step_nodes, usable, expected",
    [
        (2, 1, 1, 2, 1, 1),  # one node left of two
        (4, 2, 1, 4, 3, 2),  # three left, but four micro-batches divide among two, not three
        (4, 2, 3, 4, 3, 3),  # twelve divide among three
        (4, 2, 1, 2, 1, None),  # at min_nodes already
        (3, 1, 1, 3, 1, 1),  # a second node lost before: one left
        (2, 0, 1, 2, 1, None),  # no min_nodes
    ],
)
def test_a_step_without_a_failed_node_runs_on_the_most_nodes_that_keep_the_global_batch(
    nodes, min_nodes, accumulate, step_nodes, usable, expected
):
    slurm = SlurmConfig(nodes=nodes, min_nodes=min_nodes)
    assert fewer_nodes(slurm, accumulate, step_nodes, usable) == expected


def test_with_no_spare_left_a_failed_node_is_left_out_on_fewer_nodes(tmp_path):
    """A spare first; with none left, the nodes fewer_nodes allows; a failure that names no node,
    or the run's own, is not a reason to drop one."""
    on_fewer = decide({}, DIED, 2, 2, 0, 20, True, {}, 1, None, 0, SUSPECT, 1)
    assert on_fewer == Decision(
        "retry",
        "rank 1 on node2: Killed; no spare node left: retrying in this allocation on 1 node(s), "
        "without node2, with the global batch kept (slurm.min_nodes)",
        ("node2",),
        1,
    )
    assert on_fewer.line() == "retry node2 1"
    assert decide({}, DIED, 0, 2, 0, 20, True, {}, 1, None, 1, SUSPECT, 1).line() == "retry node2"
    assert decide(MACHINE, None, 0, 2, 0, 20, True, {}, 1, None, 0, None, 1).line() == "retry"
    assert decide(OWN, DIED, 0, 2, 0, 20, True, {}, 1, None, 0, SUSPECT, 1).action == "end"
    rundir.write_status(tmp_path, "running", restart=0)
    fewer = SlurmConfig(nodes=3, min_nodes=1, step_retries=2)
    first = recover(tmp_path, KILLED, 137, 0, 0, 6, fewer, 0, step_nodes=3, grad_accum_steps=2)
    lost = "srun: error: Node failure on node3\n"
    second = recover(
        tmp_path, lost, 1, 1, 0, 4, fewer, 0, 0, ("node2",), step_nodes=2, grad_accum_steps=2
    )
    assert (first.line(), second.line()) == ("retry node2 2", "retry node3 1")


def test_recover_counts_the_spares_earlier_retries_used(tmp_path):
    rundir.write_status(tmp_path, "running", restart=0)
    first = recover(tmp_path, KILLED, 137, 0, 0, 2, RETRY_TWICE, 0, spares=2)
    second = recover(tmp_path, KILLED, 137, 1, 0, 2, RETRY_TWICE, 0, 2, ("node2", "node3"))
    assert (first.line(), second.line()) == ("retry node2", "retry")


# What srun prints when a node of the step stops answering (its _node_fail_handler), with no line
# for the tasks that ran there.
NODE_LOST = "srun: error: Node failure on node[2-3]\nsrun: Force Terminated StepId=48872078.4\n"


def test_a_node_srun_says_failed_is_left_out_on_a_spare_and_counted_against_it(tmp_path):
    from qgtrain.launch.srun_log import lost_nodes

    assert lost_nodes(NODE_LOST) == ["node2", "node3"] and lost_nodes(KILLED) == []
    lost = Suspect("node2", "srun: Node failure on node2")
    assert decide({}, None, 0, 2, 0, 20, True, {}, 1, None, 1, lost) == Decision(
        "retry",
        "srun: Node failure on node2; retrying in this allocation on a spare node, without node2 "
        "(0 spare(s) left)",
        ("node2",),
    )
    rundir.write_status(tmp_path, "running", restart=0)
    assert recover(tmp_path, NODE_LOST, 1, 0, 0, 2, RETRY_TWICE, 1, spares=1).line() == (
        "retry node2"
    )
    # no spare left: two failures of node2 keep it away from the requeued job
    last = recover(tmp_path, NODE_LOST, 1, 2, 0, 2, RETRY_TWICE, 2, 1, ("node2",))
    assert last.line() == "requeue node2,node3"
    failures = json.loads((tmp_path / "status.json").read_text())["failures"]
    assert [f["lost"] for f in failures] == [["node2", "node3"]] * 2


@pytest.mark.parametrize(
    "how, restart, expected",
    [
        ("Exited with exit code 75", 0, ("end", "stopped the run at a checkpoint (exit 75)")),
        ("Exited with exit code 76", 0, ("requeue", "to be requeued (exit 76)")),
        ("Exited with exit code 76", 20, ("end", "to be requeued (exit 76)")),  # no restarts left
    ],
)
def test_a_stop_at_a_checkpoint_whose_peers_srun_ended_is_not_retried(how, restart, expected):
    """The first rank to exit 75 (or 76) makes srun end the others (--kill-on-bad-exit), so srun's
    own status is theirs (143): the stop, not a failure, is what the step ended with."""
    stopped = TaskFailure("node1", 0, how)
    decision = decide({}, stopped, 0, 2, restart, 20, True, {}, 1, None, 1, SUSPECT, 1)
    assert decision.action == expected[0] and expected[1] in decision.reason, decision
