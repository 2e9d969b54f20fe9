"""`qgtrain doctor`: a preflight checklist where the job will run (`srun qgtrain doctor` inside an
allocation checks every node), each check ok, warning or error with its fix.

The node-local checks come first (Python, torch, GPUs, shared memory, the run directory's
filesystem), then those that need this node's network or the other nodes: which interface NCCL and
gloo would use, whether every node sees the run directory, and with `--collective` the bandwidth
between the nodes. Last, rank 0 builds the config's task on the CPU, as every rank of the job would,
so a task that does not import or build fails here and not after the job waited in the queue. One
checklist, read top to bottom."""

from __future__ import annotations

import dataclasses
import shutil
import socket
import sys
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from ..config import RunConfig
from ..foundation.errors import QgtrainError
from ..foundation.terminal import shown
from ..runs.rundir import default_run_dir
from ..runtime import devices, precision
from ..runtime.rendezvous import DistEnv

SHARED_FILESYSTEMS = (
    "nfs",
    "nfs4",
    "lustre",
    "gpfs",
    "beegfs",
    "cephfs",
    "ceph",
    "fuse.sshfs",
    "panfs",
    "wekafs",
    "fuse.glusterfs",
    "glusterfs",
    "cifs",
    "smb3",
    "9p",
)


@dataclass(frozen=True)
class Check:
    level: str  # ok, warning, error
    name: str
    message: str
    fix: str = ""


def run_checks(
    cfg: RunConfig, env: DistEnv, environ: Mapping[str, str], collective: str | None = None
) -> list[Check]:
    """Every check; with `collective` (sizes in MB: '1,16,64') also the all-reduce bandwidth between
    the nodes."""
    from .collective import parse_sizes

    # a bad value stops here, before anything runs
    sizes = parse_sizes(collective) if collective else None
    import torch

    run_dir = default_run_dir(cfg).resolve()
    checks = [Check("ok", "python", f"Python {sys.version.split()[0]}, torch {torch.__version__}")]
    checks += _gpus(cfg, env, torch)
    checks.append(_shared_memory(cfg, env))
    checks += _slurm_commands()
    checks.append(_port(env))  # before the cross-node check, whose process group takes this port
    checks += _run_directory(cfg, env, run_dir, sizes)
    checks += _huggingface(cfg, environ)
    if env.is_main:  # after any process group of the checks above is gone: the task builds alone
        checks.append(_task(cfg))
    if sizes and env.world_size == 1:
        checks.append(
            Check(
                "warning",
                "collective",
                "one process: no other rank to exchange data with",
                "run `srun qgtrain doctor --collective` inside the allocation",
            )
        )
    return checks


def _gpus(cfg: RunConfig, env: DistEnv, torch: ModuleType) -> list[Check]:
    cuda = torch.cuda
    wanted = cfg.train.device == "cuda" or cfg.slurm.gpus_per_node > 0
    if not cuda.is_available():
        if not wanted:
            return [
                Check(
                    "ok", "GPUs", "none needed (train.device and slurm.gpus_per_node ask for none)"
                )
            ]
        level = "error" if env.in_slurm_job else "warning"
        return [
            Check(
                level,
                "GPUs",
                "no CUDA device is visible to this process",
                "run `srun qgtrain doctor` inside the GPU allocation; check --gpus-per-node and "
                "that torch is a CUDA build (setup.sh installs one where nvidia-smi works)",
            )
        ]
    try:
        choice = devices.choose(cfg.train.device, env, cuda.device_count())
        chosen = precision.choose(
            cfg.train.precision,
            choice.type,
            cuda.get_device_capability(choice.index) if choice.index is not None else None,
            rocm=bool(torch.version.hip),
        )
    except QgtrainError as exc:
        problem, _, fix = str(exc).partition(" HINT: ")
        return [Check("error", "GPUs", problem, fix)]
    nccl = ".".join(map(str, cuda.nccl.version())) if hasattr(cuda, "nccl") else "?"
    name = cuda.get_device_name(choice.index) if choice.index is not None else "no GPU"
    facts = (
        f"rank {env.rank} uses {choice.name}, {name} ({choice.why}); precision {chosen.precision} "
        f"({chosen.why}); CUDA {torch.version.cuda}, NCCL {nccl}"
    )
    return [Check("warning" if chosen.warning else "ok", "GPUs", facts, chosen.warning or "")]


def _shared_memory(cfg: RunConfig, env: DistEnv) -> Check:
    try:
        size_gb = shutil.disk_usage("/dev/shm").total / 1e9
    except OSError:
        return Check(
            "warning",
            "shared memory",
            "/dev/shm does not exist",
            "DataLoader workers pass batches through /dev/shm; "
            "set data.num_workers: 0 or mount one",
        )
    workers = cfg.data.num_workers * env.local_world_size
    if workers and size_gb < 0.5 * workers:
        return Check(
            "warning" if size_gb >= 0.1 else "error",
            "shared memory",
            f"/dev/shm has {size_gb:.2f} GB for {workers} DataLoader worker(s) on this node",
            "lower data.num_workers, or give the job more shared memory (a container's --shm-size)",
        )
    return Check(
        "ok", "shared memory", f"/dev/shm has {size_gb:.1f} GB for {workers} DataLoader worker(s)"
    )


def _slurm_commands() -> list[Check]:
    missing = [c for c in ("sbatch", "srun", "scontrol", "squeue") if not shutil.which(c)]
    checks = [
        Check("ok", "Slurm", "sbatch, srun, scontrol and squeue are on PATH")
        if not missing
        else Check(
            "warning",
            "Slurm",
            f"not on PATH: {', '.join(missing)}",
            "fine for local runs; on a cluster load its Slurm module (without scontrol in a job, "
            "qgtrain exits 76 and train.slurm requeues from the batch shell)",
        )
    ]
    if not missing and not shutil.which("sacct"):
        checks.append(
            Check(
                "warning",
                "sacct",
                "not on PATH",
                "qgtrain.submit reads job state from squeue and scontrol instead; nothing to do",
            )
        )
    return checks


def _run_directory(
    cfg: RunConfig, env: DistEnv, run_dir: Path, collective: Sequence[float] | None
) -> list[Check]:
    probe = (
        run_dir if run_dir.exists() else next((p for p in run_dir.parents if p.exists()), Path("/"))
    )
    try:
        token = probe / f".qgtrain-doctor-{uuid.uuid4().hex[:8]}"
        token.write_text("ok")
        token.unlink()
    except OSError as exc:
        return [
            Check(
                "error",
                "run directory",
                f"{probe} is not writable ({exc.strerror})",
                "set logging.runs_dir to a folder this user can write, on a shared filesystem",
            )
        ]
    fstype = _filesystem(probe)
    shared = fstype in SHARED_FILESYSTEMS
    checks = [Check("ok", "run directory", f"{run_dir} is writable ({fstype})")]
    if cfg.slurm.nodes > 1 and not shared and env.world_size == 1:
        checks.append(
            Check(
                "warning",
                "shared filesystem",
                f"{probe} is on {fstype}, which other nodes may not see",
                "multi-node jobs need the run directory on a shared filesystem; `srun qgtrain "
                "doctor` inside the job checks it from every node",
            )
        )
    network = network_check(cfg, env)
    if env.world_size > 1:
        return checks + across_nodes(cfg, env, probe, network, collective)
    return checks + [network]


def _filesystem(path: Path) -> str:
    best, kind = "", "unknown"
    try:
        with open("/proc/mounts") as mounts:
            for line in mounts:
                parts = line.split()
                if len(parts) > 2 and str(path).startswith(parts[1]) and len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    except OSError:
        pass
    return kind


def _port(env: DistEnv) -> Check:
    if env.world_size == 1 or not env.is_main:
        return Check(
            "ok",
            "rendezvous port",
            "one process needs no port"
            if env.world_size == 1
            else f"rank 0 listens on {env.master_addr}:{env.master_port}",
        )
    with socket.socket() as sock:
        try:
            sock.bind(("", env.master_port))
        except OSError as exc:
            return Check(
                "error",
                "rendezvous port",
                f"port {env.master_port} on {env.node_name} is taken ({exc.strerror})",
                "set MASTER_PORT to a free port for this job",
            )
    return Check("ok", "rendezvous port", f"{env.master_addr}:{env.master_port} is free")


def _huggingface(cfg: RunConfig, environ: Mapping[str, str]) -> list[Check]:
    checks = []
    offline = any(
        environ.get(v, "") not in ("", "0") for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )
    checks.append(
        Check("ok", "Hugging Face", "offline mode is on")
        if offline
        else Check(
            "warning",
            "Hugging Face",
            "offline mode is off",
            "compute nodes often have no network: export HF_HUB_OFFLINE=1 (qgtrain itself never "
            "downloads; model.pretrained is read from a local folder)",
        )
    )
    cache = Path(environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    checks.append(Check("ok", "Hugging Face cache", str(cache)))
    for key, folder, wanted in (
        ("model.pretrained", cfg.model.pretrained, "config.json"),
        (
            "data.tokenizer",
            None if cfg.data.tokenizer == "byte" else cfg.data.tokenizer,
            "tokenizer.json",
        ),
    ):
        if folder and not (Path(folder) / wanted).is_file():
            checks.append(
                Check(
                    "error",
                    key,
                    f"{folder} has no {wanted}",
                    "point it at a folder written by save_pretrained (e.g. by `qgtrain export`)",
                )
            )
    return checks


def _task(cfg: RunConfig) -> Check:
    """The task the config names, imported and built on the CPU without a process group (the
    built-in language model is left to the model and data checks: building it may read a large
    model or tokenize the data)."""
    import torch.distributed as dist

    from ..data.stream.kinds import is_stream
    from ..foundation.errors import summary
    from ..foundation.task import BUILTIN_LM
    from ..foundation.user_code import raised_in_users_code
    from ..tasks.build import build_task

    spec = cfg.task.factory
    if spec == BUILTIN_LM:
        return Check("ok", "task", "the built-in causal LM, built from model and data at start")
    fix = "correct the task function (`qgtrain train` would stop at the same place)"
    try:
        task = build_task(cfg)
    except QgtrainError as exc:
        problem, _, hint = str(exc).partition(" HINT: ")
        return Check("error", "task", problem, hint or fix)
    except Exception as exc:  # the user's build() raises bare Exceptions, or any other kind
        if "process group" in str(exc) and not dist.is_initialized():
            return Check(
                "warning",
                "task",
                f"{spec} asks torch.distributed for the process group, which doctor does not "
                "start: the task is built at the run's start only",
                "nothing to fix if it means to: `qgtrain train` builds it once the group is up",
            )
        where = raised_in_users_code(exc)
        said = f"task.factory: {spec} raised {summary(exc)}" + (f", in {where}" if where else "")
        return Check("error", "task", said, fix)
    size = sum(p.numel() for p in task.model.parameters())
    splits = ", ".join(
        f"{split} {'a stream' if is_stream(data) else len(data)}"
        for split in ("train", "val", "test")
        if (data := getattr(task, split)) is not None
    )
    return Check(
        "ok",
        "task",
        f"{spec} builds: {type(task.model).__name__} of {size:,} parameters, {splits}",
    )


def render(checks: list[Check], env: DistEnv) -> str:
    """The checklist, each line escaped (foundation/terminal.py): a message may quote a mount, a
    node's name or a library's error text, none of which qgtrain wrote."""
    lines = [
        f"qgtrain doctor on {env.node_name}"
        + (f" (rank 0 of {env.world_size})" if env.world_size > 1 else "")
    ]
    for check in checks:
        lines.append(f"  {check.level:<8} {check.name:<18} {check.message}")
        if check.fix and check.level != "ok":
            lines.append(f"  {'':<8} {'':<18} fix: {check.fix}")
    return "\n".join(map(shown, lines))


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.level == "error" for c in checks) else 0


def network_check(cfg: RunConfig, env: DistEnv) -> Check:
    """This node's interfaces and the one NCCL and gloo would use (train.socket_ifname, or the route
    to MASTER_ADDR)."""
    from ..foundation.errors import ConfigError
    from ..runtime import comms

    interfaces = comms.machine_interfaces()
    listed = ", ".join(
        f"{i.name} {i.address or '(no IPv4)'}{'' if i.up else ' (down)'}" for i in interfaces
    )
    try:
        choice = comms.choose_interface(
            cfg.train.socket_ifname, interfaces, comms.route_source(env.master_addr), env
        )
    except ConfigError as exc:
        return Check(
            "error",
            "network",
            f"{env.node_name}: {listed}; {exc}".split(" HINT:")[0],
            "set train.socket_ifname to an interface every node has, or '' to choose automatically",
        )
    return Check(
        "ok",
        "network",
        f"{env.node_name}: {listed}; NCCL and gloo use "
        f"{choice.name or 'their own choice'} ({choice.why})",
    )


def across_nodes(
    cfg: RunConfig, env: DistEnv, folder: Path, network: Check, collective: Sequence[float] | None
) -> list[Check]:
    """Rank 0 writes a token; the first rank on every node must find it (a real cross-node check).
    Each node's first rank also reports its network, over the interface it names (an unusable one
    fails here). With `collective`, on each rank's own device (GPUs: NCCL), the bandwidth between
    the nodes."""
    import torch

    from ..runtime import distributed

    ifname = cfg.train.socket_ifname if network.level == "ok" else ""
    device = distributed.pick_device(env, cfg.train.device) if collective else torch.device("cpu")
    with distributed.process_group(env, device, 120, 120, ifname):
        name = distributed.broadcast_from_main(f".qgtrain-doctor-{uuid.uuid4().hex[:8]}")
        token = folder / name
        if env.is_main:
            token.write_text("ok")
        distributed.barrier()
        seen = token.exists() if env.local_rank == 0 else True
        # a Check crosses as its fields: ranks send each other no class (runtime/objects.py)
        gathered = distributed.gather_to_main(
            (env.node_name, seen, dataclasses.astuple(network) if env.local_rank == 0 else None)
        )
        distributed.barrier()
        if env.is_main:
            token.unlink(missing_ok=True)
        measured = _collective(env, device, collective) if collective else []
    blind = sorted({node for node, ok, _ in gathered or [] if not ok})
    networks = [Check(*check) for _, _, check in gathered or [] if check is not None]
    if blind:
        return [
            Check(
                "error",
                "shared filesystem",
                f"node(s) {', '.join(blind)} cannot see {folder}",
                "put logging.runs_dir (and data.cache_dir) on a filesystem every node mounts",
            ),
            *networks,
            *measured,
        ]
    return [
        Check("ok", "shared filesystem", f"all {env.num_nodes} node(s) see {folder}"),
        *networks,
        *measured,
    ]


def _collective(env: DistEnv, device: Any, sizes: Sequence[float]) -> list[Check]:
    """The bandwidth checks (a collective); a rank that never answers is named from the rendezvous
    store."""
    import torch.distributed as dist

    from ..foundation.errors import first_line
    from ..runtime.diagnose import missing_ranks
    from . import collective

    try:
        result = collective.measure(env, device, sizes)
    except (RuntimeError, dist.DistError) as exc:
        verdict = collective.judge(
            [], {}, [f"rank {r}" for r in missing_ranks(env) or []] or ["a rank"]
        )
        return [
            Check(
                verdict.level, "collective", f"{verdict.message} ({first_line(exc)})", verdict.fix
            )
        ]
    if result is None:
        return []
    whole, links = collective.render(result, env.world_size)
    verdict = collective.judge(result["nodes"], result["links"])
    return [
        Check("ok", "collective", whole),
        Check("ok", "node links", links),
        Check(verdict.level, "slow nodes", verdict.message, verdict.fix),
    ]
