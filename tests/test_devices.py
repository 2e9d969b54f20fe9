"""Launch detection, the GPU each rank uses and its precision, over the environments GPU clusters
create: one GPU bound to each task, all of a node's GPUs shared by its tasks, enroot's PyTorch hook
under pyxis, torchrun inside a Slurm step, torchrun alone, one process. Runs against: tables of
those exact variables (dict in, DistEnv and device out), and `python -m qgtrain env` run as a real
process with each; the order "make the GPU current, then anything else" through a recorder standing
in for torch.cuda (no GPU here); precision from a table of GPUs' compute capabilities."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from qgtrain.foundation.errors import ConfigError, RendezvousError
from qgtrain.runtime import devices, distributed, precision
from qgtrain.runtime.devices import choose, count_without_cuda, gpu_device_files, visible_entries
from qgtrain.runtime.rendezvous import DistEnv, from_environ
from qgtrain.runtime.slurm_values import hook_port, port_for_job
from tests.helpers import fresh_cli

JOB = "48832491"


def srun_task(
    procid: int, localid: int, nodeid: int, ntasks: int = 4, per_node: str = "2(x2)", **extra: str
) -> dict[str, str]:
    """What srun gives one task of a 2-node step (names as on the test cluster)."""
    return {
        "SLURM_JOB_ID": JOB,
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": str(procid),
        "SLURM_LOCALID": str(localid),
        "SLURM_NODEID": str(nodeid),
        "SLURM_NTASKS": str(ntasks),
        "SLURM_STEP_NUM_TASKS": str(ntasks),
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu[01-02]",
        "SLURM_STEP_NODELIST": "gpu[01-02]",
        "SLURM_STEP_TASKS_PER_NODE": per_node,
        "SLURMD_NODENAME": f"gpu0{nodeid + 1}",
        **extra,
    }


def enroot_hook(task: dict[str, str]) -> dict[str, str]:
    """enroot's conf/hooks/extra/50-slurm-pytorch.sh, applied to a task's environment."""
    return {
        **task,
        "MASTER_ADDR": "gpu01",
        "MASTER_PORT": str(int(task["SLURM_JOB_ID"]) % 4536 + 61000),
        "WORLD_SIZE": task["SLURM_NTASKS"],
        "RANK": task["SLURM_PROCID"],
        "LOCAL_RANK": task["SLURM_LOCALID"],
        "OMP_NUM_THREADS": "1",
    }


TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "MASTER_ADDR": "gpu01",
    "MASTER_PORT": "29500",
}

# name, environment, (launcher, rank, local rank, world, local world, node rank, nodes), device
ENVIRONMENTS = [
    (
        "per-task binding (--gpus-per-task=1)",
        srun_task(3, 1, 1, CUDA_VISIBLE_DEVICES="1"),
        ("slurm", 3, 1, 4, 2, 1, 2),
        "cuda:0",
    ),
    (
        "--gpus-per-node=2 shared by the node's tasks",
        srun_task(3, 1, 1, CUDA_VISIBLE_DEVICES="0,1"),
        ("slurm", 3, 1, 4, 2, 1, 2),
        "cuda:1",
    ),
    (
        "enroot hook under pyxis",
        enroot_hook(srun_task(3, 1, 1, CUDA_VISIBLE_DEVICES="0,1")),
        ("slurm", 3, 1, 4, 2, 1, 2),
        "cuda:1",
    ),
    (
        "enroot hook, per-task binding",
        enroot_hook(srun_task(2, 0, 1, CUDA_VISIBLE_DEVICES="GPU-5c1a9e2f-77aa")),
        ("slurm", 2, 0, 4, 2, 1, 2),
        "cuda:0",
    ),
    (
        "torchrun inside a Slurm step",
        {
            **srun_task(1, 0, 1, ntasks=2, per_node="1(x2)"),
            **TORCHRUN,
            "RANK": "3",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "1",
            "CUDA_VISIBLE_DEVICES": "0,1",
        },
        ("torchrun", 3, 1, 4, 2, 1, 2),
        "cuda:1",
    ),
    (
        "plain torchrun",
        {
            **TORCHRUN,
            "RANK": "1",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "CUDA_VISIBLE_DEVICES": "0,1",
        },
        ("torchrun", 1, 1, 2, 2, 0, 1),
        "cuda:1",
    ),
    ("one process, no GPU", {"CUDA_VISIBLE_DEVICES": ""}, ("single", 0, 0, 1, 1, 0, 1), "cpu"),
]
NAMES = [row[0] for row in ENVIRONMENTS]


def layout(env: DistEnv) -> tuple[object, ...]:
    return (
        env.launcher,
        env.rank,
        env.local_rank,
        env.world_size,
        env.local_world_size,
        env.node_rank,
        env.num_nodes,
    )


@pytest.mark.parametrize("name, environ, expected, device", ENVIRONMENTS, ids=NAMES)
def test_each_environment_gives_its_layout_and_device(name, environ, expected, device, tmp_path):
    env = from_environ(environ, hostname="gpu01")
    assert layout(env) == expected
    assert choose("auto", env, count_without_cuda(env, dev=tmp_path)).name == device


@pytest.mark.parametrize("name, environ, expected, device", ENVIRONMENTS, ids=NAMES)
def test_qgtrain_env_reports_the_same_as_a_process(name, environ, expected, device, tmp_path):
    done = fresh_cli("env", cwd=tmp_path, env={"PATH": "/usr/bin:/bin", **environ})
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert (
        tuple(
            shown[k]
            for k in (
                "launcher",
                "rank",
                "local_rank",
                "world_size",
                "local_world_size",
                "node_rank",
                "num_nodes",
            )
        )
        == expected
    )
    assert shown["device"] == device and shown["device_why"]
    assert shown["device_index"] == (None if device == "cpu" else int(device.split(":")[1]))


def test_the_hooks_port_is_replaced_by_one_per_restart_and_step():
    task = enroot_hook(srun_task(0, 0, 0))
    first, requeued = from_environ(task), from_environ({**task, "SLURM_RESTART_COUNT": "1"})
    assert int(task["MASTER_PORT"]) == hook_port(JOB)
    assert (first.master_port, requeued.master_port) == (port_for_job(JOB, 0), port_for_job(JOB, 1))
    assert first.master_port != requeued.master_port
    assert "in place of MASTER_PORT=" in first.port_source and "container hook" in first.port_source
    pinned = from_environ({**task, "QGTRAIN_MASTER_PORT": "23456"})
    assert (pinned.master_port, pinned.port_source) == (23456, "pinned by QGTRAIN_MASTER_PORT")
    chosen = from_environ({**srun_task(0, 0, 0), "MASTER_PORT": "24000"})
    assert (chosen.master_port, chosen.port_source) == (24000, "MASTER_PORT from the environment")


@pytest.mark.parametrize(
    "variable, value, slurm",
    [
        ("RANK", "2", "SLURM_PROCID=3"),
        ("LOCAL_RANK", "0", "SLURM_LOCALID=1"),
        ("WORLD_SIZE", "8", "SLURM_NTASKS=4"),
    ],
)
def test_a_hook_layout_that_contradicts_slurm_is_refused(variable, value, slurm):
    with pytest.raises(
        RendezvousError, match=rf"^{variable}={value} contradicts this srun step's {slurm}.*HINT"
    ):
        from_environ({**enroot_hook(srun_task(3, 1, 1)), variable: value})


@pytest.mark.parametrize(
    "text, entries",
    [
        (None, None),
        ("", []),
        ("0", ["0"]),
        ("2,3", ["2", "3"]),
        ("0, 1", ["0", "1"]),
        ("NoDevFiles", []),
        ("1,-1,2", ["1"]),
        ("GPU-5c1a9e2f-77aa,GPU-0b2c", ["GPU-5c1a9e2f-77aa", "GPU-0b2c"]),
        ("MIG-GPU-5c1a/1/0", ["MIG-GPU-5c1a/1/0"]),
    ],
)
def test_cuda_visible_devices_is_read_as_cuda_reads_it(text, entries):
    assert visible_entries(text) == entries


# CUDA_VISIBLE_DEVICES, GPUs counted, local rank, ranks on the node -> device index, or the refusal
CHOICES = [
    ("3", 1, 3, 4, 0),
    ("0,1,2,3", 4, 3, 4, 3),
    (None, 8, 3, 4, 3),
    ("", 0, 0, 1, None),
    (None, 0, 1, 2, None),
    ("0", 1, 0, 1, 0),
    ("0,1", 2, 3, 4, "2 GPUs are visible to each of the 4 ranks"),
    ("0,1,2", 3, 0, 8, "3 GPUs are visible to each of the 8 ranks"),
]


@pytest.mark.parametrize("visible, count, local_rank, local_world, expected", CHOICES)
def test_the_device_follows_what_the_task_can_see(
    visible, count, local_rank, local_world, expected
):
    env = DistEnv(
        local_rank=local_rank,
        local_world_size=local_world,
        rank=local_rank,
        world_size=local_world,
        node_name="gpu01",
        cuda_visible_devices=visible,
    )
    if isinstance(expected, str):
        with pytest.raises(
            RendezvousError,
            match=rf"{expected} on gpu01 .*CUDA_VISIBLE_DEVICES=.*"
            rf"HINT: srun --gpus-per-task=1",
        ):
            choose("auto", env, count)
        return
    choice = choose("auto", env, count)
    assert choice.index == expected and choice.type == ("cpu" if expected is None else "cuda")
    assert choose("cpu", env, count).name == "cpu"


def test_cuda_asked_for_with_no_gpu_is_refused():
    with pytest.raises(
        RendezvousError, match=r"train.device is 'cuda' but no GPU is visible to rank 0"
    ):
        choose("cuda", DistEnv(cuda_visible_devices=""), 0)


def test_without_cuda_visible_devices_the_node_s_device_files_are_counted(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps"):
        (tmp_path / name).touch()
    assert gpu_device_files(tmp_path) == 2
    assert count_without_cuda(DistEnv(), dev=tmp_path) == 2
    assert count_without_cuda(DistEnv(cuda_visible_devices="5"), dev=tmp_path) == 1


class RecordingCuda:
    """Stands in for torch.cuda where no GPU exists: answers the count and records every call."""

    def __init__(self, count: int) -> None:
        self.count, self.calls = count, []

    def is_available(self) -> bool:
        self.calls.append("is_available")
        return self.count > 0

    def device_count(self) -> int:
        self.calls.append("device_count")
        return self.count

    def set_device(self, index: int) -> None:
        self.calls.append(f"set_device({index})")


def test_the_rank_makes_its_own_gpu_current_and_asks_nothing_else():
    bound = RecordingCuda(1)
    device = distributed.pick_device(
        from_environ(srun_task(3, 1, 1, CUDA_VISIBLE_DEVICES="1")), "auto", bound
    )
    assert str(device) == "cuda:0" and bound.calls == [
        "is_available",
        "device_count",
        "set_device(0)",
    ]
    shared = RecordingCuda(2)
    device = distributed.pick_device(
        from_environ(srun_task(3, 1, 1, CUDA_VISIBLE_DEVICES="0,1")), "auto", shared
    )
    assert str(device) == "cuda:1" and shared.calls[-1] == "set_device(1)"
    cpu = RecordingCuda(2)
    assert str(distributed.pick_device(DistEnv(), "cpu", cpu)) == "cpu" and cpu.calls == []


@pytest.mark.parametrize(
    "environ, named",
    [
        (
            {**enroot_hook(srun_task(3, 1, 1)), "RANK": "1"},
            ["RANK=1", "SLURM_PROCID=3", "unset RANK"],
        ),
        (
            srun_task(3, 1, 1, ntasks=8, per_node="4(x2)", CUDA_VISIBLE_DEVICES="0,1"),
            ["CUDA_VISIBLE_DEVICES='0,1'", "4 ranks", "--gpus-per-task=1", "--ntasks-per-node=2"],
        ),
    ],
)
def test_bad_launch_environments_are_one_line_and_exit_2(environ, named, tmp_path):
    done = fresh_cli("env", cwd=tmp_path, env={"PATH": "/usr/bin:/bin", **environ})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("qgtrain: error: ") and done.stderr.count("\n") == 1, done.stderr
    assert all(text in done.stderr for text in named), done.stderr


# torch.cuda functions that act on the current device when no device is given
TAKES_A_DEVICE = {
    "synchronize",
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "get_rng_state",
    "get_device_name",
    "get_device_capability",
    "get_device_properties",
    "reset_peak_memory_stats",
    "mem_get_info",
}
CURRENT_OR_ALL = {"get_rng_state_all", "set_rng_state_all", "is_bf16_supported"}


def test_every_cuda_call_that_takes_a_device_names_one():
    package = Path(distributed.__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            owner = ast.unparse(node.func.value)
            if owner.endswith("cuda") and node.func.attr in TAKES_A_DEVICE:
                assert node.args or node.keywords, (
                    f"{path.name}:{node.lineno}: {ast.unparse(node)} names no device"
                )
            assert not (owner.endswith("cuda") and node.func.attr in CURRENT_OR_ALL), (
                f"{path.name}:{node.lineno}: {ast.unparse(node)} acts on the current or every "
                "device"
            )


# train.precision, device, compute capability, ROCm -> precision, and whether it warns
PRECISION = [
    ("auto", "cuda", (7, 0), "Tesla V100-SXM2-32GB", False, "fp32", False),
    ("auto", "cuda", (7, 5), "Tesla T4", False, "fp32", False),
    ("auto", "cuda", (8, 0), "NVIDIA A100-SXM4-80GB", False, "bf16", False),
    ("auto", "cuda", (8, 9), "NVIDIA L4", False, "bf16", False),
    ("auto", "cuda", (9, 0), "NVIDIA H100 80GB HBM3", False, "bf16", False),
    ("auto", "cuda", (9, 4), "AMD Instinct MI300X", True, "bf16", False),
    ("auto", "cpu", None, "", False, "fp32", False),
    ("bf16", "cuda", (7, 0), "Tesla V100-SXM2-32GB", False, "bf16", True),
    ("bf16", "cuda", (7, 5), "Tesla T4", False, "bf16", True),
    ("bf16", "cuda", (9, 0), "NVIDIA H100 80GB HBM3", False, "bf16", False),
    ("fp16", "cuda", (7, 0), "Tesla V100-SXM2-32GB", False, "fp16", False),
    ("fp32", "cuda", (9, 0), "NVIDIA H100 80GB HBM3", False, "fp32", False),
    ("bf16", "cpu", None, "", False, "bf16", False),
]


@pytest.mark.parametrize("requested, device, capability, name, rocm, chosen, warns", PRECISION)
def test_precision_follows_native_bf16_support(
    requested, device, capability, name, rocm, chosen, warns
):
    choice = precision.choose(requested, device, capability, name, rocm)
    assert choice.precision == chosen and bool(choice.warning) == warns
    if warns:
        assert f"{name} (compute capability {capability[0]}.{capability[1]})" in choice.warning
        assert "emulates" in choice.warning and "HINT: train.precision: fp16" in choice.warning
    if requested == "auto" and device == "cuda":
        assert name in choice.why and ("natively" in choice.why) == (chosen == "bf16")


# the resolved precision, device, compute capability, ROCm -> whether fp32 matrix products use TF32
TF32 = [
    ("fp32", "cuda", (8, 0), False, True),
    ("fp32", "cuda", (9, 0), False, True),
    ("fp32", "cuda", (7, 0), False, False),
    ("fp32", "cuda", (7, 5), False, False),
    ("fp32", "cuda", (9, 4), True, False),
    ("fp32", "cpu", None, False, False),
    ("bf16", "cuda", (9, 0), False, False),
]


@pytest.mark.parametrize("chosen, device, capability, rocm, tf32", TF32)
def test_fp32_uses_tf32_tensor_cores_from_compute_capability_8(
    chosen, device, capability, rocm, tf32
):
    assert precision.uses_tf32(chosen, device, capability, rocm) == tf32


def test_fp16_on_the_cpu_is_refused():
    with pytest.raises(ConfigError, match=r"train.precision: fp16 needs a GPU"):
        precision.choose("fp16", "cpu")


# each rank's (node, device, GPU UUID) -> the ranks named as sharing one GPU, or None
SHARED_GPUS = [
    ([("n1", "cuda:0", "GPU-a"), ("n1", "cuda:1", "GPU-b")], None),
    # torchrun x2, 1 GPU
    ([("n1", "cuda:0", "GPU-a"), ("n1", "cuda:0", "GPU-a")], "ranks [0, 1] on n1"),
    # 4 tasks, 1 GPU
    (
        [
            ("n1", "cuda:0", "GPU-a"),
            ("n1", "cuda:0", "GPU-a"),
            ("n1", "cuda:0", "GPU-a"),
            ("n1", "cuda:0", "GPU-a"),
            ("n2", "cuda:0", "GPU-c"),
            ("n2", "cuda:1", "GPU-d"),
        ],
        "ranks [0, 1, 2, 3] on n1",
    ),
    # one GPU per node, index 0 on each
    ([("n1", "cuda:0", "GPU-a"), ("n2", "cuda:0", "GPU-c")], None),
    # two names, one GPU
    ([("n1", "cuda:0", "GPU-a"), ("n1", "cuda:1", "GPU-a")], "ranks [0, 1] on n1"),
]


@pytest.mark.parametrize("claims, named", SHARED_GPUS)
def test_ranks_that_would_share_a_gpu_are_named_before_nccls_join(claims, named):
    why = devices.shared_gpu(claims)
    assert (why is None) == (named is None)
    if named:
        assert (
            named in why
            and "HINT" in why
            and "--ntasks-per-node" in why
            and "--nproc_per_node" in why
        )


def claim_gpus_through_the_job_store(cards: list[str]) -> str | None:
    """The join's own check, each rank claiming card cards[rank] of one node: what the rank refuses
    with, or None."""
    import datetime
    import json
    import os

    from qgtrain.foundation.errors import RendezvousError
    from qgtrain.runtime import joining, store
    from qgtrain.runtime.rendezvous import from_environ

    env = from_environ(os.environ)
    job_store = store.job_store(env, datetime.timedelta(seconds=30))
    claim = json.dumps(["node1", f"cuda:{env.rank}", cards[env.rank]])
    try:
        joining.refuse_shared_gpus(job_store, env, claim)
        return None
    except RendezvousError as exc:
        return str(exc)


def test_ranks_tell_each_other_their_gpus_through_the_store_before_the_process_group():
    """Two ranks naming different devices that are one card (the same UUID) both refuse, naming
    each other; two cards pass. Real ranks, rank 0 hosting the store, no process group."""
    from tests.ranks import run_ranks

    one_card = run_ranks(2, claim_gpus_through_the_job_store, ["GPU-aaaa", "GPU-aaaa"])
    assert all(said and "ranks [0, 1] on node1" in said for said in one_card), one_card
    assert run_ranks(2, claim_gpus_through_the_job_store, ["GPU-aaaa", "GPU-bbbb"]) == [None] * 2
