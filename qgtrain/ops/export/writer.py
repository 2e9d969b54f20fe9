"""The one export writer: a model's weights, what rebuilds it, the run's facts and a model card, in
one folder.

Whatever the model, the folder holds `qgtrain_model.json` (what kind of export it is, the task and
options that built the model, the resolved config, the run's facts) and a `README.md` model card,
both made to be published: the config's sections about the user's own machines (PRIVATE_SECTIONS)
stay out of them; the weights are written the model's own way. A transformers PreTrainedModel and a
huggingface_hub PyTorchModelHubMixin use their own config files (their own class reloads them
without qgtrain); any other module's `state_dict` goes to `model.safetensors`, with the model's own
names, and `qgtrain.load_model(folder)` rebuilds it by calling the task function again. The weights
themselves are streamed from the checkpoint (safetensors_io.py), sharded past SHARD_SIZE as
transformers shards them, except for the hub mixin, whose loader reads one file.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

META = "qgtrain_model.json"
# Where the run was trained, not what was trained: tracker servers and projects, the runs folder
# (logging), the Slurm account, partition, setup lines and images (slurm), the export's own folder
# (export), and the paths of the downstream tasks' files (eval).
PRIVATE_SECTIONS = ("logging", "slurm", "export", "eval")
SHARD_SIZE = "2GB"
ONE_FILE = 2**62
FORMAT = 1


def kind_of(model: nn.Module) -> str:
    """transformers, hub (PyTorchModelHubMixin) or state_dict (any other module)."""
    from huggingface_hub import PyTorchModelHubMixin
    from transformers import PreTrainedModel

    if isinstance(model, PreTrainedModel):
        return "transformers"
    return "hub" if isinstance(model, PyTorchModelHubMixin) else "state_dict"


def write(
    model: nn.Module,
    folder: Path,
    meta: dict[str, Any],
    card: str,
    tokenizer: Any = None,
    *,
    weights: Callable[[Path, int], list[str]],
    dtype: torch.dtype,
) -> str:
    """Write the model into `folder` (empty) the way its kind asks, with META, the card and a
    tokenizer. `weights(folder, max_file_bytes)` writes the weights (safetensors_io.py): the model
    itself holds none."""
    kind = kind_of(model)
    if kind == "transformers":
        config: Any = getattr(model, "config")
        # as save_pretrained records them
        config.architectures, config.dtype = [type(model).__name__], dtype
        config.save_pretrained(folder)
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate")():
            generation.save_pretrained(folder)
        weights(folder, size_in_bytes(SHARD_SIZE))
    # its save_pretrained writes its init arguments; its loader reads one model.safetensors
    elif kind == "hub":
        setattr(model, "_save_pretrained", lambda directory: weights(Path(directory), ONE_FILE))
        try:
            getattr(model, "save_pretrained")(folder)
        finally:
            delattr(model, "_save_pretrained")
    else:
        weights(folder, size_in_bytes(SHARD_SIZE))
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    cls = type(model)
    (folder / META).write_text(
        json.dumps(
            {
                "format": FORMAT,
                "kind": kind,
                "class": f"{cls.__module__}.{cls.__qualname__}",
                **meta,
            },
            indent=1,
        )
        + "\n"
    )
    (folder / "README.md").write_text(card)
    return kind


def publishable(config: dict[str, Any]) -> dict[str, Any]:
    """The resolved config as an exported folder shows it: without PRIVATE_SECTIONS, which a rebuild
    of the model never reads (they come back as the defaults)."""
    return {
        section: values for section, values in config.items() if section not in PRIVATE_SECTIONS
    }


def size_in_bytes(size: str) -> int:
    """'2GB' -> 2 * 10**9, as transformers and huggingface_hub count shard sizes."""
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    return (
        int(float(size[:-2]) * units[size[-2:].upper()])
        if size[-2:].upper() in units
        else int(size)
    )


def library_of(model: nn.Module) -> str:
    """The model card's library_name: what loads the folder."""
    return "transformers" if kind_of(model) == "transformers" else "pytorch"


def model_card(
    name: str,
    what: str,
    library: str,
    task: str,
    facts: dict[str, Any],
    config: dict[str, Any],
    usage: str,
    pipeline_tag: str | None = None,
) -> str:
    """What a reader of the folder wants to know: what it is (`what`, e.g. the model's class), how
    it was trained (`config`: publishable's), how to load it."""
    import yaml

    header = ["---", f"library_name: {library}", "tags: [qgtrain]"]
    if pipeline_tag:
        header.append(f"pipeline_tag: {pipeline_tag}")
    return "\n".join(
        [
            *header,
            "---",
            f"# {name}",
            "",
            f"{what} trained with qgtrain (task `{task}`).",
            "",
            facts_table(facts),
            "",
            "```python",
            usage.strip(),
            "```",
            "",
            "## Resolved training config",
            "",
            "```yaml",
            yaml.safe_dump(config, sort_keys=False).rstrip(),
            "```",
            "",
        ]
    )


def usage(kind: str, model: nn.Module, builder: str) -> str:
    """How to load an export of this kind, as a model card shows it; `builder` says what makes the
    model."""
    cls = type(model)
    if kind == "transformers":
        return (
            'import transformers\nfolder = "path/to/this/folder"\n'
            "config = transformers.AutoConfig.from_pretrained(folder)\n"
            "model = getattr(transformers, config.architectures[0]).from_pretrained(folder)"
        )
    if kind == "hub":
        return (
            f"from {cls.__module__} import {cls.__qualname__}\n"
            f'model = {cls.__qualname__}.from_pretrained("path/to/this/folder")'
        )
    return (
        f"import qgtrain\n# builds the model: {builder} (trust_code: read that code first),\n"
        "# then loads model.safetensors into it, strictly\n"
        'model = qgtrain.load_model("path/to/this/folder", trust_code=True)\n\n'
        "# or without qgtrain, with the model built as the task builds it:\n"
        "from safetensors.torch import load_file\n"
        f"model = {cls.__qualname__}(...)\n"
        'model.load_state_dict(load_file("path/to/this/folder/model.safetensors"))  # unsharded'
    )


def facts_table(facts: dict[str, Any]) -> str:
    """The run's facts (export.run_facts) as a Markdown table."""

    def fmt(value: Any) -> str:
        return (
            "n/a" if value is None else f"{value:.4f}" if isinstance(value, float) else str(value)
        )

    rows = [
        ("qgtrain", facts.get("qgtrain", "?")),
        ("torch", facts.get("torch", "?")),
        ("checkpoint", f"`{facts['checkpoint']}`"),
        ("steps", facts["step"]),
        ("epochs begun", facts["epochs"]),
    ]
    if facts.get("tokens_seen"):
        rows.append(("tokens seen", f"{facts['tokens_seen']:,}"))
    rows.append(("final train loss", fmt(facts.get("train_loss"))))
    rows += [
        (f"final validation {name}", fmt(value)) for name, value in facts.get("val", {}).items()
    ]
    rows += [(f"test {name}", fmt(value)) for name, value in facts.get("test", {}).items()]
    rows += [
        ("precision", facts.get("precision", "?")),
        ("ranks", facts.get("ranks", "?")),
        ("parallel", facts.get("parallel", "?")),
    ]
    if facts.get("tokenizer") is not None:
        rows.append(("tokenizer", facts["tokenizer"]))
    if facts.get("weights") == "ema":
        rows.append(("weights", "the EMA of the trained weights (train.ema_decay)"))
    return "| fact | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in rows)
