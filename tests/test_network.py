"""The network interface NCCL and gloo use, and where NCCL's Flight Recorder leaves its evidence.
Runs against: tables of interfaces (pure choice), this machine's own interfaces and routes, real
`qgtrain train` processes (one refused for an interface that does not exist, two ranks over an
interface named or found)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from qgtrain.foundation.errors import ConfigError
from qgtrain.runs.rundir import RunDir
from qgtrain.runtime import comms
from qgtrain.runtime.comms import Interface, choose_interface, machine_interfaces, route_source
from qgtrain.runtime.rendezvous import DistEnv
from tests.helpers import records
from tests.ranks import start_cli_ranks, wait_ranks

NODE = [
    Interface("lo", "127.0.0.1"),
    Interface("eth0", "10.99.0.12"),
    Interface("ib0", "192.168.7.12"),
    Interface("docker0", "172.17.0.1", up=False),
]
TWO_NODES = DistEnv(
    rank=1, world_size=4, local_world_size=2, num_nodes=2, node_name="gpu02", master_addr="gpu01"
)

# train.socket_ifname, the job's own variables, the address the kernel routes MASTER_ADDR from ->
# chosen
CHOICES = [
    ("ib0", {}, "10.99.0.12", "ib0"),
    ("", {}, "192.168.7.12", "ib0"),
    ("", {}, "10.99.0.12", "eth0"),
    ("", {}, "127.0.0.1", None),  # loopback reaches no other node
    ("", {}, "10.1.1.1", None),  # no interface holds it
    ("", {}, None, None),  # no route at all
    ("", {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "eth0"}, "10.99.0.12", None),
    ("eth0", {"NCCL_SOCKET_IFNAME": "ib0", "GLOO_SOCKET_IFNAME": "ib0"}, "10.99.0.12", "eth0"),
]


@pytest.mark.parametrize("configured, preset, source, chosen", CHOICES)
def test_the_interface_is_the_named_one_or_the_one_that_routes_to_the_master(
    configured, preset, source, chosen
):
    env = DistEnv(**{**TWO_NODES.__dict__, "comm_env": tuple(preset.items())})
    choice = choose_interface(configured, NODE, source, env)
    assert choice.name == chosen
    settings = comms.socket_settings(choice, env)
    assert settings == (
        {"NCCL_SOCKET_IFNAME": chosen, "GLOO_SOCKET_IFNAME": chosen} if chosen else {}
    )


def test_a_variable_the_job_set_itself_stays_and_the_other_follows_the_route():
    env = DistEnv(**{**TWO_NODES.__dict__, "comm_env": (("NCCL_SOCKET_IFNAME", "ib"),)})
    choice = choose_interface("", NODE, "10.99.0.12", env)
    assert comms.socket_settings(choice, env) == {"GLOO_SOCKET_IFNAME": "eth0"}


def test_one_node_may_use_loopback_and_one_process_needs_no_network():
    one_node = DistEnv(world_size=2, local_world_size=2)
    assert choose_interface("", NODE, "127.0.0.1", one_node).name == "lo"
    assert choose_interface("", NODE, "127.0.0.1", DistEnv()).name is None


def test_an_interface_that_does_not_exist_is_refused_with_those_that_do():
    with pytest.raises(
        ConfigError,
        match=r"^train.socket_ifname: 'ib9' is not a network interface of gpu02 "
        r"\(it has lo, eth0, ib0, docker0\)\. HINT: .*srun qgtrain doctor",
    ):
        choose_interface("ib9", NODE, "10.99.0.12", TWO_NODES)


def test_the_flight_recorder_is_set_unless_the_job_set_it(tmp_path):
    assert comms.recorder_settings(DistEnv()) == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    }
    theirs = DistEnv(
        comm_env=(("TORCH_FR_BUFFER_SIZE", "500"), ("TORCH_NCCL_DUMP_ON_TIMEOUT", "0"))
    )
    assert comms.recorder_settings(theirs) == {}
    prefix = RunDir(tmp_path).nccl_dumps
    assert comms.dump_settings(prefix, DistEnv()) == (
        {"TORCH_FR_DUMP_TEMP_FILE": f"{tmp_path}/nccl/rank_"},
        f"{tmp_path}/nccl/rank_",
    )
    assert comms.dump_settings(
        prefix, DistEnv(comm_env=(("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "/x/t_"),))
    ) == ({}, "/x/t_")


def test_this_machine_s_interfaces_and_routes_are_read():
    interfaces = {i.name: i for i in machine_interfaces()}
    assert interfaces["lo"].address == "127.0.0.1" and interfaces["lo"].up
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert route_source("no-such-host.invalid") is None


def test_qgtrain_train_refuses_an_interface_that_does_not_exist(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "qgtrain",
            "train",
            "--set",
            "data.name=synthetic",
            "train.socket_ifname=nope0",
            f"logging.runs_dir={tmp_path}",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    error = [line for line in done.stderr.splitlines() if line.startswith("qgtrain: error:")]
    assert (
        len(error) == 1 and "train.socket_ifname: 'nope0' is not a network interface of" in error[0]
    )
    assert "lo" in error[0] and not (tmp_path / "tiny-gpt2" / "checkpoints").exists()


TINY = [
    "data.name=synthetic",
    "data.seq_len=16",
    "train.batch_size=4",
    "logging.tensorboard=false",
    "model.factory=tests.factories:tiny",
    "train.max_steps=3",
    "train.eval_every=0",
    "checkpoint.every_steps=0",
]


@pytest.mark.parametrize("named", ["lo", ""])
def test_two_ranks_train_over_the_interface_named_or_found(named, tmp_path):
    run = tmp_path / "run"
    procs = start_cli_ranks(
        2,
        ["train", "--run-dir", str(run), "--set", *TINY, f"train.socket_ifname={named}"],
        tmp_path,
    )
    assert wait_ranks(procs, 240) == [0, 0], (tmp_path / "rank-0.out").read_text()[-2000:]
    said = (tmp_path / "rank-0.out").read_text()
    why = (
        "train.socket_ifname" if named else "its address 127.0.0.1 routes to MASTER_ADDR 127.0.0.1"
    )
    assert f"network interface lo ({why}): NCCL_SOCKET_IFNAME=lo, GLOO_SOCKET_IFNAME=lo" in said
    assert records(run)[-1]["step"] == 3
    assert Path(run / "logs" / "rank_1.log").is_file()
