"""One command for the first machine with GPUs: run qgtrain's CUDA paths end to end and say what passed.

    python -m bench.gpu_check            # 1 GPU, and 2 GPUs where there are two
    python -m bench.gpu_check --keep     # keep the run folders (printed) for a look afterwards

On 1 and 2 GPUs (torchrun, one rank per GPU): each rank's device and the order "GPU made current, then
everything else" (its shards and its pinned async snapshot on its own GPU, no second GPU copy of them); ddp
in bf16 and fp16 and fsdp in bf16, each with async checkpoints, SIGKILLed mid-run and resumed, compared with
an uninterrupted run; the precision `auto` picks; `qgtrain export` of the result. The comparison is bit for
bit where two uninterrupted runs agree bit for bit; GPU kernels that add with atomics (embedding backward)
may not, and then the resumed run must stay within the spread of the two. Prints one line per check and
exits 1 if any failed; on a machine without CUDA it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["data.name=synthetic", "data.synthetic_samples=4096", "data.seq_len=64", "model.hidden=128",
         "model.layers=2", "model.heads=4", "train.batch_size=8", "train.max_steps=200", "train.log_every=1",
         "train.eval_every=50", "train.eval_batches=2", "checkpoint.every_steps=50", "checkpoint.async_save=true",
         "logging.tensorboard=false", "optim.warmup_steps=4", "train.device=cuda"]
MODES = [("ddp", "bf16"), ("ddp", "fp16"), ("fsdp", "bf16")]
results: list[tuple[bool, str, str]] = []


def check(ok: bool, name: str, detail: str = "") -> bool:
    results.append((ok, name, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}{': ' + detail if detail else ''}", flush=True)
    return ok


def launch(world: int, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    """`qgtrain <args>` as `world` torchrun ranks, in a process group of its own (so a SIGKILL takes all)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", "-m",
           "qgtrain", *args]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("ab"), stderr=subprocess.STDOUT, start_new_session=True)


def train_args(run: Path, parallel: str, precision: str) -> list[str]:
    return ["train", "--config", str(ROOT / "config.yaml"), "--run-dir", str(run), "--set", *SMALL,
            f"train.parallel={parallel}", f"train.precision={precision}", f"data.cache_dir={run.parent / 'data'}"]


def losses(run: Path) -> dict[int, float]:
    found = {}
    text = (run / "metrics.jsonl").read_text() if (run / "metrics.jsonl").exists() else ""
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line being written
        found[record["step"]] = record["loss"]
    return found


def train(world: int, run: Path, parallel: str, precision: str, timeout: float = 900) -> int:
    proc = launch(world, train_args(run, parallel, precision), run.parent / f"{run.name}.log")
    return proc.wait(timeout=timeout)


def killed_and_resumed(world: int, run: Path, parallel: str, precision: str) -> int | str:
    """SIGKILL every rank once checkpoint step-100 is committed and a later step is logged; then resume.
    Returns the resumed run's exit code, or what went wrong before the kill."""
    proc = launch(world, train_args(run, parallel, precision), run.parent / f"{run.name}.log")
    deadline = time.monotonic() + 900
    while not ((run / "checkpoints" / "step-100" / "manifest.json").exists() and max(losses(run), default=0) > 110):
        if proc.poll() is not None:
            return f"ended (exit {proc.returncode}) before it could be killed"
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            return "did not reach step 110 in 900 s"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return train(world, run, parallel, precision)


def compare(world: int, parallel: str, precision: str, folder: Path) -> None:
    name = f"{world} GPU(s) {parallel} {precision}"
    runs = [folder / f"{world}-{parallel}-{precision}-{tag}" for tag in ("a", "b", "killed")]
    codes = [train(world, runs[0], parallel, precision), train(world, runs[1], parallel, precision),
             killed_and_resumed(world, runs[2], parallel, precision)]
    if not check(codes == [0, 0, 0], f"{name}: trains, and resumes after SIGKILL", f"exit codes {codes}"):
        return
    a, b, resumed = (losses(run) for run in runs)
    spread = max(abs(a[s] - b[s]) for s in a)
    worst = max(abs(a[s] - resumed.get(s, float("inf"))) for s in a)
    if spread == 0:
        check(worst == 0, f"{name}: the resumed run equals an uninterrupted one bit for bit",
              f"largest difference {worst:.3g}")
    else:
        check(worst <= 2 * spread, f"{name}: the resumed run stays within two uninterrupted runs' spread",
              f"largest difference {worst:.3g}, spread {spread:.3g} (these kernels are not deterministic)")
    logs = [(runs[0] / "logs" / f"rank_{rank}.log").read_text(errors="replace") for rank in range(world)]
    check(all(f"device cuda:{rank}\n" in log for rank, log in enumerate(logs)),
          f"{name}: every rank trains on its own GPU", "device cuda:<local rank> in each rank's log")
    check((runs[0] / "nccl").is_dir() and "NCCL Flight Recorder" in logs[0],
          f"{name}: NCCL's Flight Recorder dumps into the run directory", str(runs[0] / "nccl"))
    if parallel == "ddp" and precision == "bf16":
        exported = folder / f"export-{world}"
        done = subprocess.run([sys.executable, "-m", "qgtrain", "export", str(runs[2]), "--out", str(exported)],
                              cwd=ROOT, capture_output=True, text=True, timeout=900)
        check(done.returncode == 0, f"{name}: qgtrain export", (done.stdout or done.stderr).strip()[-300:])


def placement(world: int, folder: Path) -> None:
    """Each rank's current device, its DDP replica, its FSDP shards and its async snapshot (a probe run as
    torchrun ranks of this script)."""
    out = folder / f"probe-{world}"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={world}", "-m", "bench.gpu_check", "--probe", str(out)], cwd=ROOT,
                            stdout=(folder / f"probe-{world}.log").open("ab"), stderr=subprocess.STDOUT)
    code = proc.wait(timeout=600)
    seen = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    if not check(code == 0 and len(seen) == world, f"{world} GPU(s): placement probe ran", f"exit {code}"):
        return
    for rank, facts in enumerate(seen):
        check(facts["current"] == facts["local_rank"] == facts["ddp"] == facts["shards"],
              f"{world} GPU(s) rank {rank}: current device, DDP replica and FSDP shards on its own GPU",
              json.dumps({k: facts[k] for k in ("current", "local_rank", "ddp", "shards")}))
        check(facts["snapshot"] == ["cpu", True, "cpu"] and facts["snapshot_gpu_bytes"] == 0,
              f"{world} GPU(s) rank {rank}: the async snapshot of its shards is pinned host memory on a CPU mesh",
              f"{facts['snapshot']}, GPU memory grew by {facts['snapshot_gpu_bytes']} bytes")


def probe(out: Path) -> None:
    """One torchrun rank: what lands where (written for placement())."""
    import torch
    from torch.distributed.tensor import DTensor

    from qgtrain.runtime import distributed
    from qgtrain.runtime.rendezvous import from_environ
    from qgtrain.state.checkpointer import CpuSnapshot
    from qgtrain.training import sharding

    env = from_environ(os.environ)
    device = distributed.pick_device(env, "cuda")
    with distributed.process_group(env, device, 120, 120):
        ddp_model = torch.nn.Linear(8, 8).to(device)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).to(device)
        sharded = sharding.shard(model, list(model), "bf16", device) if env.world_size > 1 else model
        torch.optim.AdamW(sharded.parameters()).step()
        shard = next(iter(sharded.state_dict().values()))
        local = shard.to_local() if isinstance(shard, DTensor) else shard
        before = torch.cuda.memory_allocated(device)
        copy = CpuSnapshot().copy({"w": shard})["w"]
        grew = torch.cuda.memory_allocated(device) - before
        copied = copy.to_local() if isinstance(copy, DTensor) else copy
        mesh = copy.device_mesh.device_type if isinstance(copy, DTensor) else "cpu"
        facts = {"local_rank": env.local_rank, "current": torch.cuda.current_device(),
                 "ddp": ddp_model.weight.device.index, "shards": local.device.index,
                 "snapshot": [copied.device.type, copied.is_pinned(), mesh], "snapshot_gpu_bytes": grew}
        (out / f"rank-{env.rank}.json").write_text(json.dumps(facts))


def auto_precision(folder: Path) -> None:
    import torch

    from qgtrain.runtime import precision

    capability = torch.cuda.get_device_capability(0)
    expected = precision.choose("auto", "cuda", capability, rocm=bool(torch.version.hip)).precision
    native = torch.cuda.is_bf16_supported(including_emulation=False)
    check((expected == "bf16") == native, "precision auto agrees with torch's native-bf16 answer",
          f"capability {capability}, auto -> {expected}, is_bf16_supported(including_emulation=False) = {native}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    parser.add_argument("--probe", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe(args.probe)
        return 0
    import torch

    if not torch.cuda.is_available():
        print(f"no CUDA device here (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'no'}): "
              "run this on a machine with GPUs", file=sys.stderr)
        return 2
    count = torch.cuda.device_count()
    print(f"{count} GPU(s): {', '.join(torch.cuda.get_device_name(i) for i in range(count))}; torch "
          f"{torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    folder = Path(tempfile.mkdtemp(prefix="qgtrain-gpu-check-"))
    try:
        auto_precision(folder)
        for world in [w for w in (1, 2) if w <= count]:
            placement(world, folder)
            for parallel, precision in MODES:
                if parallel == "fsdp" and world == 1:
                    continue  # one rank shards nothing
                compare(world, parallel, precision, folder)
    finally:
        if args.keep:
            print(f"runs kept in {folder}")
        else:
            shutil.rmtree(folder, ignore_errors=True)
    failed = [name for ok, name, _ in results if not ok]
    print(f"{len(results) - len(failed)} of {len(results)} checks passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
