"""`qgtrain.load_model(folder)`: the trained module back from an export, in two lines, whatever the
model.

    import qgtrain
    model = qgtrain.load_model("models/molecules")

An export of a transformers model or a PyTorchModelHubMixin loads through its class's own
from_pretrained. Any other model is rebuilt by calling the run's task function with the run's config
(qgtrain_model.json), then its weights are loaded from model.safetensors (or its shards), strictly:
a folder whose weights do not fit the rebuilt model is refused in one line naming what differs, and
nothing of qgtrain's checkpoint format is needed. A task file the export carries (its `code/`,
export/bundle.py) is named relative to the folder, so the folder loads wherever it is.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config.load import config_from_dict
from ..foundation.errors import CheckpointError
from ..foundation.folder_code import remote_code, trusting_its_flag
from ..foundation.trust import Named, config_code, require
from .export.bundle import resolved
from .export.rebuild import rebuild_model
from .export.writer import META


@trusting_its_flag("trust_code=True")  # and a model folder's own code (folder_code.py)
def load_model(folder: str | Path, *, trust_code: bool = False) -> nn.Module:
    """The model exported to `folder`, on the CPU in fp32, in eval mode. Code its qgtrain_model.json
    names beyond the built-ins (a task function, a model class of yours) is imported only with
    `trust_code=True`, whoever owns the folder (trust.py): read that code first, as for a Hugging
    Face folder's trust_remote_code. So is code a transformers folder it reads names (auto_map),
    and then only from a folder of yours that no one else can write (folder_code.py)."""
    return exported_model(Path(folder), trust_code)


def exported_model(folder: Path, trust_code: bool) -> nn.Module:
    """load_model's model, the code of the folders it reads left to the caller's decision
    (folder_code.trusting): export reloads the folder it wrote trusting the run's factories, not
    a model folder's code."""
    meta = read_meta(folder)
    if meta["kind"] == "state_dict":
        model = _rebuild(meta, folder, trust_code)
        load_weights_strictly(model, folder, meta["class"])
    elif meta["kind"] == "hub":
        model = _hub_model(_exported_class(meta, folder, trust_code), folder)
    else:  # transformers: the class's own from_pretrained
        code = remote_code(folder, "load_model")
        model = _exported_class(meta, folder, trust_code).from_pretrained(
            folder, trust_remote_code=code
        )
    return model.float().eval()


def _hub_model(cls: Any, folder: Path) -> Any:
    """A PyTorchModelHubMixin's from_pretrained: its config.json holds the class's init arguments
    and names no code, and a trust_remote_code given to it would reach the model's __init__."""
    return cls.from_pretrained(folder)


def _rebuild(meta: dict[str, Any], folder: Path, trust_code: bool) -> nn.Module:
    cfg = config_from_dict(meta["config"], str(folder / META))
    _require(config_code(cfg), folder, trust_code)
    return rebuild_model(resolved(cfg, folder), meta.get("model_facts", {}))


def _exported_class(meta: dict[str, Any], folder: Path, trust_code: bool) -> Any:
    """The model's class, imported by name; a class defined in a task file (imported by qgtrain
    under a name of its own) comes from building the model once. A built-in name must name a
    transformers model class, whose from_pretrained runs no code from the folder."""
    _require([Named("class", meta["class"])], folder, trust_code)
    module, _, name = meta["class"].rpartition(".")
    try:
        found = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, TypeError, ValueError):
        return type(_rebuild(meta, folder, trust_code))
    if not trust_code and not _transformers_model(found):
        raise CheckpointError(
            f"load_model: the class {meta['class']!r} in {folder / META} is "
            "not a transformers model class. HINT: if you trust the folder, pass "
            "trust_code=True"
        )
    return found


def _transformers_model(found: Any) -> bool:
    from transformers import PreTrainedModel

    return isinstance(found, type) and issubclass(found, PreTrainedModel)


def _require(named: list[Named], folder: Path, trust_code: bool) -> None:
    if not trust_code:
        require(
            named,
            folder / META,
            what="load_model",
            fix="trust_code=True",
            why_not="an export folder counts as yours only with trust_code=True (a copy or "
            "download of someone's folder is owned by you)",
        )


def read_meta(folder: Path) -> dict[str, Any]:
    path = folder / META
    if not path.is_file():
        raise CheckpointError(
            f"load_model: {folder} has no {META}, so it is not a folder written by `qgtrain "
            "export`. HINT: export the run first (qgtrain export RUN_DIR --out FOLDER); a "
            "transformers folder loads with its class's from_pretrained"
        )
    return dict(json.loads(path.read_text()))


def load_weights_strictly(model: nn.Module, folder: Path, exported_class: str) -> None:
    """Every tensor of the model from the folder, with nothing missing, extra or of another shape. A
    tensor that shares memory with another (tied weights) is written once and filled through its
    partner."""
    saved = read_weights(folder)
    own = model.state_dict()
    written = {_storage(own[k]) for k in saved if k in own}
    missing = [k for k in own if k not in saved and _storage(own[k]) not in written]
    extra = sorted(set(saved) - set(own))
    shapes = [
        f"{k} {tuple(saved[k].shape)} in the folder, {tuple(own[k].shape)} in the model"
        for k in own
        if k in saved and saved[k].shape != own[k].shape
    ]
    if missing or extra or shapes:
        cls = type(model)
        built = f"{cls.__module__}.{cls.__qualname__}"
        differs = "; ".join(
            [f"shapes differ: {', '.join(shapes[:3])}"] * bool(shapes)
            + [f"not in the folder: {', '.join(missing[:5])}"] * bool(missing)
            + [f"not in the model: {', '.join(extra[:5])}"] * bool(extra)
        )
        raise CheckpointError(
            f"load_model: the weights in {folder} (of a {exported_class}) do not fit the {built} "
            f"that its task builds now: {differs}. HINT: the folder holds another model's weights, "
            "or the task or its options changed since the export; load it with the code and "
            f"{META} it was exported with"
        )
    model.load_state_dict(saved, strict=False)  # strict above, tied partners included


def read_weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointError(
            f"load_model: {folder} has neither model.safetensors nor model.safetensors.index.json"
        )
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(folder / name))
    return weights


def _storage(tensor: torch.Tensor) -> tuple[int, str]:
    return tensor.untyped_storage().data_ptr(), str(tensor.device)
