"""Models too big for one rank: memory at start, resume time and export memory, each against its
baseline.

start: per-rank peak RSS growth (VmHWM from /proc, over the rank's RSS before the model is built)
after the model is sharded and after the first optimizer step, for today's sharded start (every rank
builds the whole model, then shards it: qgtrain before issue 24) and qgtrain's (rank 0 builds, the
others are sent their shards), at 2 and 4 gloo ranks, on a GPT-2 of --layers x --hidden.

resume: the time from a start's decision to resume to the state being loaded, qgtrain's path (rank 0
lists the candidates from manifests and sizes, every rank checksums its share, the ranks agree, DCP
loads the shards) against `dcp.load` of the same sharded checkpoint by hand (no checks), alternated,
with the page cache dropped before each load (root only; without root both read from a warm cache),
at 2 and 4 ranks, for checkpoints of about 1 and 4 GB (stacks of 4096 x 4096 layers with their AdamW
state).

export: peak RSS growth of `qgtrain export` of a 2-rank fsdp run against the export as it was before
(the model rebuilt whole, the shards read into it, save_pretrained), for two model sizes.
Usage: python -m bench.big_model [--only start|resume|export] [--layers 12 --hidden 1024] [--gb 1 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def status_bytes(key: str) -> int:
    return (
        int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1])
        * 1024
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn(world: int, fn: Any, *args: Any) -> dict[int, Any]:
    port = free_port()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(world, port, fn, args, out), nprocs=world)
        return dict(out)


def _rank(
    rank: int, world: int, port: int, fn: Any, args: tuple[Any, ...], out: dict[int, Any]
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    from qgtrain.runtime.distributed import process_group
    from qgtrain.runtime.rendezvous import from_environ

    env = from_environ(os.environ)
    with process_group(env, torch.device("cpu"), 120, 1800):
        out[rank] = fn(env, *args)


MODES = {
    "every rank builds (before)": "today",
    "meta, each rank inits its shards": "meta-init",
    "rank 0 builds, sends shards (qgtrain)": "qgtrain",
}


def start_rank(env: Any, sets: list[str], mode: str) -> dict[str, Any]:
    from qgtrain.config import OptimConfig
    from qgtrain.config.load import load_config
    from qgtrain.runtime import rng
    from qgtrain.tasks.build import build_task
    from qgtrain.tasks.empty_weights import building_empty
    from qgtrain.training.optimizers import adamw
    from qgtrain.training.parallel import sharding
    from qgtrain.training.parallel.strategy import strategy_for

    cfg, cpu = load_config([], sets), torch.device("cpu")
    strategy = strategy_for(cfg.train, env, cpu)
    before, started = status_bytes("VmRSS:"), time.perf_counter()
    rng.seed_everything(cfg.train.seed)
    if mode == "today":
        model = build_task(cfg).model
        sharding.shard(model, sharding.find_blocks(model, ()), "fp32", cpu)
    elif mode == "meta-init":  # torchtitan's way: no rank builds, each initialises its own shards
        with building_empty(meta=True):
            model = build_task(cfg).model
        strategy.wrap(model, False, "fp32")
        with torch.no_grad():
            for module in model.modules():
                model._init_weights(module)
    else:
        model = build_task(cfg, empty=strategy.builds_empty(False)).model
        strategy.wrap(model, False, "fp32")
    took, at_start = time.perf_counter() - started, status_bytes("VmHWM:") - before
    sums = torch.stack([fingerprint(t.to_local()) for t in model.state_dict().values()])
    dist.all_reduce(sums)
    optimizer = adamw(model, OptimConfig(), cpu)
    ids = torch.randint(0, 257, (1, 32), generator=torch.Generator().manual_seed(env.rank))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return {
        "start": at_start / 1e6,
        "step": (status_bytes("VmHWM:") - before) / 1e6,
        "s": took,
        "sums": sums,
    }


def one_process_sums(sets: list[str]) -> torch.Tensor:
    from qgtrain.config.load import load_config
    from qgtrain.runtime import rng
    from qgtrain.tasks.build import build_task

    cfg = load_config([], sets)
    rng.seed_everything(cfg.train.seed)
    return torch.stack([fingerprint(t) for t in build_task(cfg).model.state_dict().values()])


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of a float32 tensor's bit patterns as integers: exact in any order, so shards add up
    to it."""
    return tensor.detach().contiguous().view(torch.int32).long().sum()


def start(layers: int, hidden: int) -> None:
    sets = [
        f"model.layers={layers}",
        f"model.hidden={hidden}",
        "model.heads=16",
        "data.name=synthetic",
        "data.seq_len=32",
        "data.synthetic_samples=64",
        "train.parallel=fsdp",
    ]
    size = 4 * (12 * layers * hidden * hidden + (257 + 32) * hidden) / 1e6
    expected = one_process_sums(sets)
    print(
        f"start: GPT-2 {layers} x {hidden}, about {size:.0f} MB in fp32; per-rank peak RSS growth "
        "in MB, rank 0 / ranks 1+ (max); tensors equal to a one-process build with the same seed"
    )
    for world in (2, 4):
        for name, mode in MODES.items():
            got = spawn(world, start_rank, sets, mode)
            equal = int((got[0]["sums"] == expected).sum())
            print(
                f"  {world} ranks, {name}: at start {got[0]['start']:.0f} / "
                f"{max(got[r]['start'] for r in range(1, world)):.0f}, after the first step "
                f"{got[0]['step']:.0f} / {max(got[r]['step'] for r in range(1, world)):.0f}; start "
                f"{got[0]['s']:.1f} s; equal {equal} of {len(expected)}"
            )


def resume_rank(env: Any, root: str, layers: int, repeats: int) -> dict[str, list[float]]:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load
    from torch.distributed.fsdp import fully_shard

    from qgtrain.config import CheckpointConfig
    from qgtrain.runtime.distributed import broadcast_from_main
    from qgtrain.state import sharded, verify_ranks
    from qgtrain.state.checkpoint import read_manifest
    from qgtrain.state.checkpointer import Checkpointer
    from qgtrain.state.resume import Candidates, resume_candidates

    with torch.device("meta"):
        model = torch.nn.Sequential(
            *[torch.nn.Linear(4096, 4096, bias=False) for _ in range(layers)]
        )
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device="cpu")
    optimizer = torch.optim.AdamW(model.parameters())
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    saver = Checkpointer(Path(root), "bench", env, CheckpointConfig(keep_last=2))
    saver.save(
        1,
        dict,
        {"rng": torch.get_rng_state()},
        {},
        blocking=True,
        shards=sharded.sharded_state(model, optimizer),
    )

    def qgtrain_resume() -> None:
        found = Candidates(
            **broadcast_from_main(
                dataclasses.asdict(resume_candidates(saver.storage, "auto", print))
                if env.is_main
                else None
            )
        )
        checking = time.perf_counter()
        chosen, _ = verify_ranks.choose(found, Path(root))
        times["of which checks"].append(time.perf_counter() - checking)
        ckpt = read_manifest(Path(str(chosen)))
        assert ckpt is not None
        sharded.load(ckpt, model, optimizer)

    def by_hand() -> None:
        state = sharded.sharded_state(model, optimizer)
        load(state, storage_reader=FileSystemReader(Path(root, "step-1", sharded.FOLDER)))
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )

    times: dict[str, list[float]] = {"qgtrain": [], "dcp.load by hand": [], "of which checks": []}
    for round_ in range(repeats):
        for name, work in (
            list(times.items())[:2] if round_ % 2 == 0 else list(times.items())[1::-1]
        ):
            if env.is_main and os.geteuid() == 0:
                os.sync()
                Path("/proc/sys/vm/drop_caches").write_text("3\n")
            dist.barrier()
            started = time.perf_counter()
            (qgtrain_resume if name == "qgtrain" else by_hand)()
            dist.barrier()
            work.append(time.perf_counter() - started)
    return times


def resume(sizes_gb: list[float], repeats: int) -> None:
    print(
        f"resume: time to a loaded state, medians of {repeats}, page cache dropped before each: "
        f"{os.geteuid() == 0}"
    )
    for gb in sizes_gb:
        layers = max(1, round(gb * 1e9 / (3 * 4 * 4096 * 4096)))
        for world in (2, 4):
            root = tempfile.mkdtemp(prefix="qgtrain-bench-resume-")
            try:
                times = spawn(world, resume_rank, root, layers, repeats)[0]
            finally:
                shutil.rmtree(root, ignore_errors=True)
            ours, theirs, checks = (
                statistics.median(times[k])
                for k in ("qgtrain", "dcp.load by hand", "of which checks")
            )
            print(
                f"  {layers * 3 * 4 * 4096 * 4096 / 1e9:.1f} GB, {world} ranks: qgtrain {ours:.2f} "
                f"s (checksums {checks:.2f} s), dcp.load by hand {theirs:.2f} s: ratio "
                f"{ours / theirs:.3f} (goal <= 1.2)"
            )


BEFORE = """
import sys, tempfile
from pathlib import Path
from qgtrain.ops.export import rebuild
from qgtrain.ops.export.origin import yaml_config
from qgtrain.state import checkpoint, sharded
ckpt = checkpoint.list_committed(Path(sys.argv[1]) / 'checkpoints')[-1]
model = rebuild.rebuild_lm(ckpt.path, yaml_config(ckpt), {})
sharded.load_model(ckpt, model)
model.save_pretrained(sys.argv[2], max_shard_size='2GB')
"""
NOW = (
    "import sys\nfrom qgtrain.ops.export.pipeline import export_run\n"
    "export_run(sys.argv[1], sys.argv[2])\n"
)
MEASURED = """
import transformers.models.gpt2.modeling_gpt2, torch.distributed.checkpoint
import qgtrain.ops.export.pipeline
def status(key):
    return int(next(l for l in open('/proc/self/status') if l.startswith(key)).split()[1]) * 1024
before = status('VmRSS:')
{body}
print(status('VmHWM:') - before)
"""


def export(shapes: list[tuple[int, int]]) -> None:
    print("export of a 2-rank fsdp run, peak RSS growth of the exporting process:")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for layers, hidden in shapes:
        with tempfile.TemporaryDirectory(prefix="qgtrain-bench-export-") as tmp:
            run = Path(tmp, "run")
            train = [
                sys.executable,
                "-m",
                "qgtrain",
                "train",
                "--config",
                str(ROOT / "config.yaml"),
                "--run-dir",
                str(run),
                "--set",
                f"model.layers={layers}",
                f"model.hidden={hidden}",
                "model.heads=8",
                "data.name=synthetic",
                "data.seq_len=32",
                "data.synthetic_samples=64",
                "train.max_steps=1",
                "train.eval_every=0",
                "train.parallel=fsdp",
                "logging.tensorboard=false",
            ]
            port = str(free_port())
            procs = [
                subprocess.Popen(
                    train,
                    env={
                        **env,
                        "RANK": str(r),
                        "LOCAL_RANK": str(r),
                        "WORLD_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": port,
                    },
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                for r in range(2)
            ]
            assert [p.wait() for p in procs] == [0, 0], "training the model to export failed"
            grown = {}
            for name, body in (("before", BEFORE), ("qgtrain", NOW)):
                command = [
                    sys.executable,
                    "-c",
                    MEASURED.format(body=body),
                    str(run),
                    str(Path(tmp, name)),
                ]
                done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                grown[name] = int(done.stdout.strip().splitlines()[-1]) / 1e6
            size = sum(p.stat().st_size for p in Path(tmp, "qgtrain").glob("*.safetensors"))
            print(
                f"  GPT-2 {layers} x {hidden}, {size / 1e6:.0f} MB of weights: before "
                f"{grown['before']:.0f} MB, qgtrain {grown['qgtrain']:.0f} MB"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("start", "resume", "export"))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--gb", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    if args.only in (None, "start"):
        start(args.layers, args.hidden)
    if args.only in (None, "resume"):
        resume(args.gb, args.repeats)
    if args.only in (None, "export"):
        export([(12, 512), (args.layers, args.hidden)])


if __name__ == "__main__":
    main()
