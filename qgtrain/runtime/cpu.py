"""How a rank uses the CPU it trains on: its share of the node's cores, and a malloc that keeps
memory.

glibc's malloc hands large freed blocks back to the kernel (munmap, or trimming the heap), so the
next step's activations of the same size are faulted in and zeroed again page by page, every step
(thousands of page faults; tests/test_cpu.py counts them, bench.train_speed shows the cost); a
caching allocator (CUDA's, jemalloc, tcmalloc) never pays it. Serving blocks up to glibc's largest
mmap threshold from the heap, and trimming the heap only past 2 GiB free, does the same: a rank then
holds on to its peak memory for the whole run, as it would on a GPU.
"""

from __future__ import annotations

import ctypes
import os

import torch

from .rendezvous import DistEnv

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit systems
_TRIM_THRESHOLD = 2**31 - 1  # the largest value mallopt takes (a C int)


def set_cpu_threads(env: DistEnv, configured: int) -> int:
    """Give each rank its share of this node's CPUs, so N ranks on one node do not oversubscribe
    it."""
    if configured:
        threads = configured
    elif env.cpus_per_task:
        threads = env.cpus_per_task
    else:
        threads = max(1, len(os.sched_getaffinity(0)) // max(env.local_world_size, 1))
    torch.set_num_threads(threads)
    return threads


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse. False where malloc is not glibc's (musl,
    macOS)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
