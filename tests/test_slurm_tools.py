"""Slurm-facing tools on the real test cluster: the nodelist table against scontrol's own expansion,
and `qgtrain doctor --collective` naming the node whose link is throttled (tc's token bucket on
node3's link)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qgtrain.runtime.slurm_values import expand_nodelist
from tests.helpers import NODELISTS

pytestmark = [pytest.mark.slurm]


def test_nodelist_table_agrees_with_real_scontrol(slurm_cluster):
    """The fixture installs Slurm where it can, so this runs in CI rather than skipping on a fresh
    machine."""
    for nodelist, hosts in NODELISTS:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            env={"SLURM_CONF": str(slurm_cluster), "PATH": "/usr/bin:/bin"},
            check=True,
        ).stdout.split()
        assert out == hosts == expand_nodelist(nodelist)


def test_doctor_names_the_node_whose_link_is_throttled(slurm_cluster, tmp_path):
    """node3's link from the cluster's bridge goes through a 10 Mbit/s token bucket; the links
    between node1 and node2 stay as they are."""
    throttle = [
        "tc",
        "qdisc",
        "add",
        "dev",
        "veth-qg3",
        "root",
        "tbf",
        "rate",
        "10mbit",
        "burst",
        "32kbit",
        "latency",
        "400ms",
    ]
    subprocess.run(throttle, check=True)
    try:
        result = subprocess.run(
            [
                "srun",
                "--nodes=3",
                "--ntasks-per-node=1",
                "--time=5",
                f"--chdir={tmp_path}",
                sys.executable,
                "-m",
                "qgtrain",
                "doctor",
                "--collective",
                "0.05,0.5",
                "--set",
                f"logging.runs_dir={tmp_path}",
            ],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "veth-qg3", "root"], check=False)
    out = result.stdout
    assert result.returncode == 1 and "qgtrain doctor on node1 (rank 0 of 3)" in out, (
        result.stdout + result.stderr
    )
    assert "all-reduce over 3 ranks on 3 node(s), bus bandwidth: 0.05 MB " in out
    assert all(f"node{a}-node{b} " in out for a, b in ((1, 2), (1, 3), (2, 3)))
    slow = next(line for line in out.splitlines() if " slow nodes " in line)
    assert (
        slow.lstrip().startswith("error")
        and "node3 (its best link" in slow
        and "--exclude=node3)" in out
    )
    assert "node1 (its" not in slow and "node2 (its" not in slow
    for n in (1, 2, 3):
        assert (
            f"network            node{n}: " in out
            and f"use eth0 (its address 10.99.0.1{n} routes to MASTER_ADDR node1)" in out
        ), out
