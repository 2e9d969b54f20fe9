"""The loop a user would write by hand (nanoGPT-style), the baseline qgtrain is measured against.

Launched once per rank with torchrun's variables. Same model (GPT-2 from a transformers config,
built as qgtrain builds a new run's: the tanh GELU, SDPA, the byte vocabulary padded to 320 rows and
the loss over its 257 real ones), same token file, batch, sequence length, seed, AdamW,
learning-rate schedule (nanoGPT's warmup then cosine, with config.yaml's values), clipping and
backend as qgtrain's job; on a GPU, the same bf16 or fp16 autocast (GradScaler for fp16), fused
AdamW and optional torch.compile; no key/value cache in the forward (use_cache=False: a training
step has no use for one). Prints one JSON line per logged step with the wall-clock time.
Usage: see bench/train_speed.py.
"""

import argparse
import contextlib
import json
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import AutoConfig, AutoModelForCausalLM

# wall-clock marks of the start, for the bench's side-by-side breakdown
STARTED = {"imports": time.time()}

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
LR, MIN_LR, WARMUP = 2e-3, 2e-4, 50
VOCAB, PADDED_VOCAB = 257, 320


def get_lr(it: int, max_steps: int) -> float:
    """qgtrain.training.schedule.lr_at written out again on purpose: the baseline imports nothing of
    qgtrain."""
    if it < WARMUP:
        return LR * (it + 1) / WARMUP
    progress = min((it - WARMUP) / max(max_steps - WARMUP, 1), 1.0)
    return MIN_LR + 0.5 * (1.0 + math.cos(math.pi * progress)) * (LR - MIN_LR)


def main() -> None:
    parser = argparse.ArgumentParser()
    for name, kind in [
        ("tokens", str),
        ("steps", int),
        ("batch", int),
        ("seq", int),
        ("log_every", int),
        ("hidden", int),
        ("layers", int),
        ("heads", int),
    ]:
        parser.add_argument(f"--{name}", type=kind, required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    STARTED["process group"] = time.time()
    rank, world = dist.get_rank(), dist.get_world_size()
    if not cuda:
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    torch.manual_seed(1337)
    config = AutoConfig.for_model(
        "gpt2",
        vocab_size=PADDED_VOCAB,
        activation_function="gelu_pytorch_tanh",
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        max_position_embeddings=args.seq,
        bos_token_id=256,
        eos_token_id=256,
        pad_token_id=None,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(device)
    STARTED["task"] = time.time()
    ddp = DDP(
        torch.compile(model) if args.compile else model, device_ids=[local_rank] if cuda else None
    )
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
        **({"fused": True} if cuda else {}),
    )
    scaler = torch.amp.GradScaler(device.type, enabled=args.precision == "fp16")
    autocast = (
        torch.autocast(device.type, dtype=DTYPES[args.precision])
        if args.precision in DTYPES
        else contextlib.nullcontext()
    )
    data = np.memmap(args.tokens, dtype=np.uint16, mode="r")
    windows = len(data) // args.seq
    order = torch.randperm(windows, generator=torch.Generator().manual_seed(1337))[rank::world]
    STARTED["wrapping and loaders"] = time.time()
    for step in range(1, args.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = get_lr(step - 1, args.steps)
        index = order[((step - 1) * args.batch) % len(order) :][: args.batch].tolist()
        x = torch.from_numpy(
            np.stack([data[i * args.seq : (i + 1) * args.seq].astype(np.int64) for i in index])
        )
        x = x.pin_memory().to(device, non_blocking=True) if cuda else x
        with autocast:
            logits = ddp(input_ids=x, use_cache=False).logits
            real = logits[:, :-1, :VOCAB].flatten(0, 1)
            loss = F.cross_entropy(real.float(), x[:, 1:].flatten())
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == 1:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                now = time.time()
                marks = {"marks": {**STARTED, "first step": now}} if step == 1 else {}
                print(
                    json.dumps({"step": step, "loss": mean.item() / world, "time": now, **marks}),
                    flush=True,
                )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
