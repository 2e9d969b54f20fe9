"""The first thing to run on a lent GPU machine: `python -m bench.gpu_check [--keep]`.

On every GPU count, 1 included (where qgtrain itself wraps nothing): DDP, fsdp and (2+ GPUs) hsdp
built directly on a real NCCL group and stepped through qgtrain's accumulation, clipping, update and
agreement against a plain model (probe.py), with GPU memory per rank against expected shares
(memory.py); gpt2-124m at batch 16 and 64 with qgtrain's defaults against the hand-written loop
compiled alike (bench/train_speed.py): tokens/s, MFU, start to first step and data wait, held to
issue 47's goals (checks.py); no host sync on non-logging steps under CUDA's sync debug mode
(runner.py); ddp bf16 and fp16 (and fsdp bf16 on 2+ GPUs) through `qgtrain train`, straight through
and SIGKILLed then resumed, compared under deterministic settings, with the async checkpoint's stall
and `qgtrain export` (runs.py). Every wait is bounded; a timeout is a FAIL with the log's tail. One
markdown table at the end, for the README.

`--only-speed` runs the gpt2-124m readings alone (`--speed-rounds`, default 2), for a short lease.
Exit 0 when all passed, 1 when any failed; without CUDA, a CPU dry run of the same flow (gloo, a
tiny model) and exit 2 (1 if the dry run failed).
"""
