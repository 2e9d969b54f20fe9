"""One torchrun rank of the wrapper check: DDP, fsdp and (on 2+ ranks) hsdp built and stepped
directly, at any world size, including 1, where qgtrain itself wraps nothing
(training/parallel/strategy.py).

Each layout takes three steps of two micro-batches through qgtrain's own pieces (parallel/step.py's
ParallelModel backward and clip, and apply_update) and is held against a plain model stepped the
same way on the whole global batch: the loss, the first step's gradients and the weights after. The
reference runs first and is kept on the host, so the rank's GPU memory after a step is the layout's
alone (memory.py says what it should be). fp32 without TF32, and AdamW with eps 1e-3 so that a
gradient that differs in its last bits moves a weight by about as much, not by a whole learning
rate (Adam's update is g / (|g| + eps)). The agreement (training/agreement.py)
carries a stop flag raised on the last rank at step 2 to every rank through its pinned
FlagsOnHost, and one NCCL all-reduce is checked by value.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from qgtrain.config import OptimConfig, TrainConfig
from qgtrain.runtime import distributed, mesh
from qgtrain.runtime.rendezvous import from_environ
from qgtrain.training.agreement import Agreement, Flags
from qgtrain.training.optimizers import adamw
from qgtrain.training.parallel import sharding
from qgtrain.training.parallel.step import ParallelModel, apply_update
from qgtrain.training.parallel.strategy import KINDS

STEPS, ACCUM, BATCH, VOCAB = 3, 2, 4, 257
OPTIM = OptimConfig(lr=1e-3, eps=1e-3, weight_decay=0.1)


def gpt2(hidden: int, layers: int, seq: int) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "gpt2",
        vocab_size=VOCAB,
        n_embd=hidden,
        n_layer=layers,
        n_head=4,
        n_positions=seq,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def loss_fn(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), batch[:, 1:].flatten())


def global_batch(step: int, micro: int, world: int, seq: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (world * BATCH, seq), generator=generator)


def reference(model: nn.Module, world: int, seq: int, device: torch.device) -> dict[str, Any]:
    """The plain model on every rank's data: the mean of the ranks' mean losses, as the wrappers
    reduce."""
    model = model.to(device)
    optimizer = adamw(model, OPTIM, device)
    losses, grads = [], {}
    for step in range(1, STEPS + 1):
        total = torch.zeros((), device=device)
        for micro in range(ACCUM):
            for part in global_batch(step, micro, world, seq).to(device).chunk(world):
                loss = loss_fn(model, part) / (ACCUM * world)
                loss.backward()
                total += loss.detach()
        if step == 1:
            grads = {
                n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None
            }
        torch.nn.utils.clip_grad_norm_(model.parameters(), OPTIM.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total.item())
    return {
        "losses": losses,
        "grads": grads,
        "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
    }


def full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def largest_diff(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest difference relative to the largest expected value of each tensor; inf for a
    missing one."""
    worst = 0.0
    for name, want in expected.items():
        if name not in found or found[name].shape != want.shape:
            return float("inf")
        scale = want.abs().max().item() or 1.0
        worst = max(worst, (found[name].float() - want.float()).abs().max().item() / scale)
    return worst


def wrap(layout: str, model: nn.Module, device: torch.device, world: int) -> nn.Module:
    model = model.to(device)
    if layout == "ddp":
        return DDP(
            model, device_ids=distributed.ddp_device_ids(device), gradient_as_bucket_view=True
        )
    blocks = sharding.find_blocks(model, [])
    if layout == "fsdp":
        return sharding.shard(model, blocks, "fp32", device)
    group = max(1, world // 2)  # hsdp: two replicas, each sharded over half the ranks
    rows = [list(range(start, start + group)) for start in range(0, world, group)]
    return sharding.shard(model, blocks, "fp32", device, mesh.two_d_mesh(rows, device.type, 120))


def stepped(
    layout: str, model: nn.Module, world: int, seq: int, device: torch.device
) -> dict[str, Any]:
    """qgtrain's pieces over this rank's share of the same batches; memory as the step leaves it."""
    rank, cuda = dist.get_rank(), device.type == "cuda"
    # the previous layout's DDP holds cycles: freed later, they would shrink this figure
    gc.collect()
    baseline = torch.cuda.memory_allocated(device) if cuda else 0
    wrapped = wrap(layout, model, device, world)
    after_wrap = torch.cuda.memory_allocated(device) - baseline if cuda else 0
    inner = wrapped.module if isinstance(wrapped, DDP) else wrapped
    optimizer = adamw(inner, OPTIM, device)
    strategy = KINDS[layout](TrainConfig(parallel=layout), from_environ(os.environ), device)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    parallel = ParallelModel(strategy, inner, wrapped, optimizer, scaler, "fp32")
    skip = torch.zeros((), dtype=torch.bool, device=device)
    losses, grads, after_step = [], {}, 0
    for step in range(1, STEPS + 1):
        micro = [
            global_batch(step, m, world, seq).chunk(world)[rank].to(device) for m in range(ACCUM)
        ]
        loss = parallel.backward(loss_fn, micro)
        if step == 1:
            grads = {n: full(p.grad) for n, p in inner.named_parameters() if p.grad is not None}
        parallel.clip(OPTIM.grad_clip)
        apply_update(optimizer, scaler, skip)
        after_step = torch.cuda.memory_allocated(device) - baseline if cuda else 0
        optimizer.zero_grad(set_to_none=True)
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
    return {
        "losses": losses,
        "grads": grads,
        "params": {n: full(p) for n, p in inner.named_parameters()},
        "memory_bytes": after_step,
        "memory_after_wrap": after_wrap,
        "snapshot": snapshot(inner, device),
        "ddp_device_ids": getattr(wrapped, "device_ids", None),
        "params_device": str(next(inner.parameters()).device),
    }


def agreement_lands(device: torch.device, world: int) -> dict[str, Any]:
    """The steps at which this rank reads a stop that only the last rank raised, at step 2."""
    agreement, clean = Agreement(device), torch.zeros((), dtype=torch.bool, device=device)
    seen = []
    for step in range(1, 7):
        agreement.start(Flags(stop_requested=dist.get_rank() == world - 1 and step == 2), clean)
        flags = agreement.read(clean, step)
        if flags.stop:
            seen.append([step, flags.as_of])
    agreement.finish()
    return {"stop_read_at": seen, "host_copy_pinned": agreement._landing._buffer.is_pinned()}


def collective(device: torch.device, world: int) -> dict[str, Any]:
    value = torch.full((4,), float(dist.get_rank() + 1), device=device)
    dist.all_reduce(value)
    gathered = torch.empty(4 * world, device=device)
    dist.all_gather_into_tensor(gathered, value)
    return {
        "all_reduce": value.tolist(),
        "gathered_sum": gathered.sum().item(),
        "backend": dist.get_backend(),
    }


def snapshot(model: nn.Module, device: torch.device) -> dict[str, Any]:
    """Where the async checkpoint's copy of a weight lands, and what it costs the GPU (nothing:
    pinned host memory, on a CPU mesh for a shard)."""
    from torch.distributed.tensor import DTensor

    from qgtrain.state.host_copy import HostCopy

    weight = next(iter(model.state_dict().values()))
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    copied = HostCopy().copy({"w": weight})["w"]
    grew = (torch.cuda.memory_allocated(device) if device.type == "cuda" else 0) - before
    local = copied.to_local() if isinstance(copied, DTensor) else copied
    return {
        "device": local.device.type,
        "pinned": local.is_pinned(),
        "gpu_bytes": grew,
        "shard_device": str((weight.to_local() if isinstance(weight, DTensor) else weight).device),
    }


def sizes(model: nn.Module) -> dict[str, int]:
    """Parameters in all, and in the largest FSDP unit (a block, or the root's own: embeddings and
    norms)."""
    blocks = sharding.find_blocks(model, [])
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    root = sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)
    largest = max([root, *(sum(p.numel() for p in block.parameters()) for block in blocks)])
    return {"params": sum(p.numel() for p in model.parameters()), "largest_unit": largest}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], required=True)
    parser.add_argument("--deterministic", action="store_true")
    args = parser.parse_args()
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    device = torch.device("cuda", local) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    try:
        hidden, layers, seq = (512, 4, 128) if device.type == "cuda" else (64, 2, 32)
        model = gpt2(hidden, layers, seq)
        facts: dict[str, Any] = {
            "rank": rank,
            "local_rank": local,
            "world": world,
            "current": torch.cuda.current_device() if device.type == "cuda" else None,
            **sizes(model),
            "collective": collective(device, world),
            "agreement": agreement_lands(device, world),
        }
        want = reference(copy.deepcopy(model), world, seq, device)
        torch.cuda.empty_cache() if device.type == "cuda" else None
        for layout in ["ddp", "fsdp", *(["hsdp"] if world >= 2 and world % 2 == 0 else [])]:
            got = stepped(layout, copy.deepcopy(model), world, seq, device)
            facts[layout] = {
                "losses": got["losses"],
                "want_losses": want["losses"],
                "grad_diff": largest_diff(got["grads"], want["grads"]),
                "param_diff": largest_diff(got["params"], want["params"]),
                **{
                    k: got[k]
                    for k in (
                        "memory_bytes",
                        "memory_after_wrap",
                        "snapshot",
                        "ddp_device_ids",
                        "params_device",
                    )
                },
            }
        (args.out / f"rank-{rank}.json").write_text(json.dumps(facts))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
