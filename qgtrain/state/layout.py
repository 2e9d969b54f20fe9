"""A checkpoint folder's file names: the one place they are spelled (runs/rundir.py spells the run
directory's).

    <run dir>/checkpoints/
        step-<N>/                    committed: counts only if its manifest parses (checkpoint.py)
            manifest.json            every file below with its size and xxh3 checksum; written last
            config.yaml              the resolved config the run trained with (rank 0)
            model.json               the model's class and the task's facts (rank 0)
            hf_config.json           a transformers model's own config, for export (rank 0)
            state.json               the train state: step, outcome, precision, adapter (rank 0)
            model.pt                 the weights, replicated runs (ddp, one process; rank 0)
            optim.pt                 the optimizer and grad scaler (rank 0)
            ema.pt                   the EMA of the weights (replicated runs, train.ema_decay > 0)
            rank-<N>.pt              each rank's own: its RNG and data position
            sharded/                 fsdp: weights, optimizer and `ema.<parameter>` entries, by DCP
                .metadata            DCP's index of the shards
                __<N>_<i>.distcp     rank N's shards
        .tmp-step-<N>-<run id>/      being written; never counts, removed when found stale
        .deleting-step-<N>/          being removed by rotation; no longer a checkpoint

The names are the on-disk format: checkpoints written by earlier versions are found by them, so a
name changes only with checkpoint.FORMAT. PLACES says where each named part of the training state
(named.py) lives in these files: a new part takes a place here, in a file of its own or as a new
entry of one above, and the files written before it are read as they were.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

MANIFEST = "manifest.json"
CONFIG = "config.yaml"
MODEL_FACTS = "model.json"
HF_CONFIG = "hf_config.json"
STATE = "state.json"
MODEL = "model.pt"
OPTIM = "optim.pt"
EMA = "ema.pt"
EMA_KEY = "ema"  # the prefix of the EMA's entries in sharded/: `ema.<parameter>`
SHARDED = "sharded"
SHARDED_METADATA = f"{SHARDED}/.metadata"

STEP_PATTERN = re.compile(r"step-(\d+)")
STAGING_PREFIX = ".tmp-step-"
DELETING_PREFIX = ".deleting-"
REPLACED_PREFIX = ".replaced-"
# The files one rank writes itself, and so checks first on resume: its rank file and its shards
OWN_FILE = re.compile(r"rank-(\d+)\.pt|sharded/__(\d+)_\d+\.distcp")


RANK_FILE = "rank-<N>.pt"  # a place's file: each rank's own, rank_file(rank)
# What a sharded model's checkpoint holds in sharded/ instead (its parts with a `sharded` entry)
REPLACED_BY_SHARDS = frozenset({MODEL, OPTIM, EMA})


@dataclass(frozen=True)
class Place:
    """Where a named part's state lives: its entries are those of `file` (key None: the file's own
    top-level entries, beside those of the other parts placed there) or of the entry `key` in it.
    `sharded`: its entry in sharded/ under fsdp, where DCP writes it instead (None: not saved
    then)."""

    file: str
    key: str | None = None
    sharded: str | None = None

    @property
    def per_rank(self) -> bool:
        return self.file == RANK_FILE


PLACES = {
    "facts": Place(STATE),  # precision, world size, versions, adapter: what judges a resume
    "train_state": Place(STATE, "trainer"),
    "spikes": Place(STATE, "trainer"),
    "horizon": Place(STATE, "trainer"),
    "model": Place(MODEL, sharded="model"),
    "optimizer": Place(OPTIM, "optimizer", sharded="optim"),
    "scaler": Place(OPTIM, "scaler"),
    "ema": Place(EMA, sharded=EMA_KEY),
    "rng": Place(RANK_FILE, "rng"),
    "data": Place(RANK_FILE),
    "stream": Place(RANK_FILE, "stream"),
}


def step_folder(step: int) -> str:
    return f"step-{step}"


def staging_folder(step: int, run_id: str) -> str:
    return f"{STAGING_PREFIX}{step}-{run_id}"


def rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def top_level(world_size: int, sharded: bool, ema: bool, hf_config: bool) -> set[str]:
    """What a committed step-<N>/ holds at its top: the tree above, for a run of that kind."""
    names = {MANIFEST, CONFIG, MODEL_FACTS, STATE, *map(rank_file, range(world_size))}
    names |= {HF_CONFIG} if hf_config else set()
    names |= {SHARDED} if sharded else {MODEL, OPTIM}
    return names | ({EMA} if ema and not sharded else set())


def run_files(config: bytes, model: Any, facts: dict[str, Any]) -> dict[str, bytes]:
    """What every checkpoint of a run carries as it is: the resolved config, the model's class and
    the task's facts, and a Hugging Face model's own config."""
    described = {"class": type(model).__name__, **facts}
    files = {CONFIG: config, MODEL_FACTS: json.dumps(described).encode()}
    if hasattr(model, "config") and hasattr(model.config, "to_json_string"):
        files[HF_CONFIG] = model.config.to_json_string().encode()
    return files
