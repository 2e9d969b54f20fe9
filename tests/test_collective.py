"""`qgtrain doctor --collective`: the pairing schedule, bus bandwidth and the verdict as tables; the
measurement over real gloo ranks standing for three nodes. The throttled node on the Slurm test
cluster is in test_slurm_tools.py."""

from __future__ import annotations

import itertools
import os

import pytest

from qgtrain.ops.collective import bus_gbps, judge, rounds
from tests.helpers import fresh_cli
from tests.ranks import run_ranks


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 8])
def test_every_pair_of_nodes_meets_once_and_no_node_twice_in_a_round(count):
    schedule = rounds(count)
    pairs = [pair for turn in schedule for pair in turn]
    assert sorted(pairs) == list(itertools.combinations(range(count), 2))
    for turn in schedule:
        nodes = [node for pair in turn for node in pair]
        assert len(nodes) == len(set(nodes))
    assert len(schedule) == (0 if count == 1 else count - 1 if count % 2 == 0 else count)


def test_bus_bandwidth_is_nccl_tests_definition():
    assert bus_gbps(10**9, 1.0, 2) == pytest.approx(1.0)
    assert bus_gbps(10**9, 1.0, 8) == pytest.approx(1.75)


FAST, SLOW = 1.2, 0.0011
VERDICTS = [
    (
        ["a", "b", "c"],
        {("a", "b"): FAST, ("a", "c"): SLOW, ("b", "c"): SLOW},
        [],
        "error",
        ["c (its best link", "--exclude=c)"],
    ),
    (
        ["a", "b", "c", "d"],
        {
            ("a", "b"): FAST,
            ("a", "c"): FAST,
            ("a", "d"): SLOW,
            ("b", "c"): 1.1,
            ("b", "d"): SLOW,
            ("c", "d"): None,
        },
        [],
        "error",
        ["d (its best link"],
    ),
    (
        ["a", "b", "c"],
        {("a", "b"): FAST, ("a", "c"): 0.9, ("b", "c"): 1.0},
        [],
        "ok",
        ["no node is slower"],
    ),
    (["a", "b"], {("a", "b"): SLOW}, [], "ok", ["one link only"]),
    (["a"], {}, [], "ok", ["one node"]),
    (["a", "b", "c"], {}, ["c"], "error", ["node(s) c never answered", "--exclude=c"]),
]


@pytest.mark.parametrize("nodes, links, silent, level, said", VERDICTS)
def test_a_node_slower_by_a_clear_factor_or_silent_is_named(nodes, links, silent, level, said):
    verdict = judge(nodes, links, silent)
    assert verdict.level == level and all(text in verdict.message + verdict.fix for text in said), (
        verdict
    )
    named = [n for n in nodes if f"{n} (its best" in verdict.message]
    assert len(named) <= 1


def measured_as_three_nodes() -> object:
    import torch

    from qgtrain.ops.collective import measure
    from qgtrain.runtime import distributed
    from qgtrain.runtime.rendezvous import from_environ

    env = from_environ(os.environ)
    node = dict(
        env.__dict__,
        node_rank=env.rank,
        node_name=f"n{env.rank}",
        local_rank=0,
        local_world_size=1,
        num_nodes=3,
    )
    env = type(env)(**node)
    with distributed.process_group(env, torch.device("cpu"), 60, 60):
        return measure(env, torch.device("cpu"), [0.01, 0.1])


def test_the_measurement_gives_every_link_and_the_whole_allocation():
    results = run_ranks(3, measured_as_three_nodes)
    assert results[1] is None and results[2] is None, "rank 0 reports"
    result = results[0]
    assert result["nodes"] == ["n0", "n1", "n2"] and list(result["whole"]) == [0.01, 0.1]
    assert sorted(result["links"]) == [("n0", "n1"), ("n0", "n2"), ("n1", "n2")]
    assert all(bw > 0 for bw in [*result["links"].values(), *result["whole"].values()])


def test_bad_sizes_are_one_line_exit_2(tmp_path):
    done = fresh_cli("doctor", "--collective", "1,big", cwd=tmp_path)
    assert (
        done.returncode == 2
        and done.stderr
        == "qgtrain: error: --collective '1,big': give sizes in MB between 0 "
        "and 4096, e.g. 1,16,64\n"
    )
