"""A checkpoint as a table of named parts: each part's state saved where layout.PLACES puts it, in
the files of checkpoint.py's format, and each given back its own on resume.

The trainer registers its parts (anything with DCP's state_dict/load_state_dict, stateful.py) under
their names; this module alone turns them into files and back, so the files stay exactly what
earlier versions wrote and read. Parts placed in one file or entry share it, each with its own keys
(the train state, the spike window and the horizon are all state.json's `trainer`). On resume every
part is loaded in the order it was registered: a part may rely on those before it (the facts of
the save first: the world size and the base that judge the rest). A part the checkpoint does not
hold (an older checkpoint, a run without it) is given an empty state.

Under fsdp the weights, the optimizer and the EMA are DCP's (sharded.py, ema_files.py), read in one
collective that no file of one part could be: those parts' states go into sharded/ under their
`sharded` entries, and come back through those modules. A record older than a part's place is
upgraded here, by the part's name (UPGRADES), never by the part.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

import yaml

from . import ema_files, layout, sharded
from .checkpoint import Checkpoint, load_file, load_json
from .layout import PLACES, REPLACED_BY_SHARDS, Place
from .manifest_files import read_regular
from .stateful import ModelState, OptimizerState, Stateful, loading

Parts = Mapping[str, Stateful]


def replicated_files(parts: Parts, by_shards: bool) -> dict[str, Any]:
    """What rank 0 writes: every part that is not a rank's own nor, saved `by_shards`, a shard."""
    files: dict[str, Any] = {}
    for name, part in parts.items():
        place = place_of(name)
        if not place.per_rank and not (by_shards and place.file in REPLACED_BY_SHARDS):
            _put(files, place, part.state_dict())
    return {
        name: json.dumps(entries, indent=1).encode() if name.endswith(".json") else entries
        for name, entries in files.items()
    }


def rank_entries(parts: Parts) -> dict[str, Any]:
    """What this rank writes into its own file (rank-<N>.pt)."""
    files: dict[str, Any] = {}
    for name, part in parts.items():
        if place_of(name).per_rank:
            _put(files, place_of(name), part.state_dict())
    return files.get(layout.RANK_FILE, {})


def shards(parts: Parts) -> dict[str, Any]:
    """What every rank writes into sharded/ where the parts are saved by shards (fsdp, hsdp)."""
    found = {
        place_of(name).sharded: part.state_dict()
        for name, part in parts.items()
        if place_of(name).sharded is not None
    }
    return {key: state for key, state in found.items() if key is not None and state}


def load(ckpt: Checkpoint, parts: Parts, rank: int, by_shards: bool) -> None:
    """Give every part its state from `ckpt`, in the order registered (collectives where the parts
    are held `by_shards`, or the checkpoint was saved so)."""
    by_dcp = sharded.is_sharded_checkpoint(ckpt) or by_shards
    read: dict[str, Any] = {}
    with loading(ckpt):
        for name, part in parts.items():
            place = place_of(name)
            if by_dcp and place.file in REPLACED_BY_SHARDS:
                _load_by_dcp(ckpt, name, part, parts)
                continue
            file = layout.rank_file(rank) if place.per_rank else place.file
            state = _read(ckpt, file, read)
            if place.key is not None:
                state = state.get(place.key, {})
            part.load_state_dict(UPGRADES.get(name, _as_saved)(ckpt, state))


def place_of(name: str) -> Place:
    if name not in PLACES:
        raise AssertionError(
            f"the part {name!r} has no place in a checkpoint: give it one in state/layout.py PLACES"
        )
    return PLACES[name]


def _put(files: dict[str, Any], place: Place, state: dict[str, Any]) -> None:
    """A part's entries into its file (a whole-file part with none writes no file: no EMA). A part
    alone in its place is written as it gave it: a model's state_dict keeps its `_metadata`."""
    if not state and place.key is None:
        return
    holder = files if place.key is None else files.setdefault(place.file, {})
    name = place.file if place.key is None else place.key
    holder[name] = {**holder[name], **state} if name in holder else state


def _read(ckpt: Checkpoint, file: str, read: dict[str, Any]) -> Any:
    """A file of the checkpoint, read once; empty when the checkpoint has none of that name."""
    if file not in read:
        if file not in ckpt.manifest.get("files", {}):
            read[file] = {}
        elif file.endswith(".json"):
            read[file] = load_json(ckpt, file)
        else:
            read[file] = load_file(ckpt, file)
    return read[file]


def _load_by_dcp(ckpt: Checkpoint, name: str, part: Stateful, parts: Parts) -> None:
    """A sharded checkpoint, or any into a sharded model: the weights and the optimizer together
    (either kind into either kind: sharded.load), the EMA (ema_files.load); the loss scaler, not
    saved under fsdp, stays as built."""
    if name == "model":
        optimizer = parts.get("optimizer")
        if not isinstance(part, ModelState) or not isinstance(optimizer, OptimizerState):
            raise AssertionError("under fsdp a checkpoint's model and optimizer are read together")
        sharded.load(ckpt, part.model, optimizer.optimizer)
    elif name == "ema":
        averages = part.state_dict()
        if not averages:  # a run without EMA: the part says what it does with a saved one
            part.load_state_dict(dict.fromkeys(ema_files.names(ckpt)))
        elif not ema_files.load(ckpt, averages):  # filled in place, or none saved
            part.load_state_dict({})


def _as_saved(ckpt: Checkpoint, state: Any) -> Any:
    return state


def _horizon_from_config(ckpt: Checkpoint, state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint from before the horizon was recorded: the train.max_steps of its config.yaml."""
    if state.get("max_steps") is not None:
        return state
    try:
        saved = yaml.safe_load(read_regular(ckpt.path / layout.CONFIG))
        return {**state, "max_steps": int(saved["train"]["max_steps"])}
    except (OSError, yaml.YAMLError, KeyError, TypeError, ValueError):
        return {**state, "max_steps": None}


UPGRADES: dict[str, Callable[[Checkpoint, Any], Any]] = {"horizon": _horizon_from_config}
