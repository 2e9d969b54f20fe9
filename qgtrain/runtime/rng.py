"""Every random number generator a rank draws from, captured and restored as plain tensors and
lists.

Stored with torch.save and loaded with weights_only=True, so a checkpoint never needs to unpickle
code.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """Each rank's own stream (dropout, augmentation), reproducible from the run's seed; `step`
    re-seeds a resume on another world size, whose saved streams belong to ranks that no longer
    exist."""
    return seed + 7919 * rank + step


def capture() -> dict[str, Any]:
    """Every stream this rank draws from; on a GPU, that of its own device only, the current one
    (made so before anything touched CUDA): a requeued job may see its GPUs numbered differently,
    and asking every visible GPU would wake a CUDA context on each."""
    version, state, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    return {
        "python": {"version": version, "state": list(state), "gauss": gauss},
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state(torch.cuda.current_device())]
        if torch.cuda.is_initialized()
        else [],
    }


def restore(state: dict[str, Any]) -> None:
    """Put back what capture took. Checkpoints written before the rank kept only its own GPU's
    stream hold one per visible GPU: the rank's is the one at its device index."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": npy["key"].numpy().astype(np.uint32), "pos": npy["pos"]},
            "has_gauss": npy["has_gauss"],
            "gauss": npy["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
    cuda, device = (
        state["cuda"],
        torch.cuda.current_device() if torch.cuda.is_initialized() else None,
    )
    if cuda and device is not None:
        torch.cuda.set_rng_state(cuda[0] if len(cuda) == 1 else cuda[device], device)
