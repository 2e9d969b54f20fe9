"""The merged export of a LoRA run on a pretrained folder, written tensor by tensor in bounded
memory.

The exporting process never holds the merged model: the base is built from its config.json without
weights (names, shapes, ties), peft's layers are put into it holding the checkpoint's adapters (the
only real tensors), and each tensor is read from the base folder's safetensors as it is written
(safetensors_io.write_weights, sharded as transformers shards): an adapted weight as W plus its
delta, computed by peft's own layer (get_delta_weight: lora_alpha / lora_rank, GPT-2's Conv1D (in,
out) layout through fan_in_fan_out, an embedding's transposed factors), in fp32 as peft merges a
base loaded in fp32, then in export.dtype; every other tensor as the folder holds it. Peak memory:
the adapters, and one tensor of the base in fp32 with its delta.

An adapted weight the model ties to another (lm_head to the input embedding) is untied: written as
its own tensor, with tie_word_embeddings false in config.json, as peft's merge_and_unload writes it
once the tie is broken (`untie_adapted`). Merged into the shared tensor, as peft does on a tied
model (it warns), the delta would change the input embedding too: the model would no longer compute
the trained one's outputs, and the check below would refuse it.

The check: every tensor read back through safetensors equals what was written, bit for bit; a model
up to reload.OUTPUTS_CHECKED_UP_TO in fp32 is also run before writing as training ran it (the
PeftModel: base and adapters in fp32; for a bf16 export, merged by peft and rounded to bf16), its
outputs kept and the model freed, and the folder loaded by AutoModelForCausalLM alone must give
them: one full model in memory at a time, never two. A larger model is checked by names and shapes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ...foundation.errors import QgtrainError
from ...foundation.folder_code import remote_code
from ...tasks.empty_weights import building_empty
from ...tasks.pretrained import safetensors_files
from ...training.adapters import ADAPTER_NAME
from . import rebuild, reload, safetensors_io, writer

Outputs = Callable[[], list[torch.Tensor]]  # the run's model's outputs, built and freed inside


def streamable(base: Path) -> bool:
    """A folder whose weights safetensors reads one tensor at a time (not pytorch_model.bin)."""
    return bool(safetensors_files(base))


def write(
    base: Path,
    adapters: safetensors_io.Reader,
    lora: Any,
    folder: Path,
    dtype: torch.dtype,
    run: Callable[[nn.Module], None],
    expected: Outputs,
) -> float | None:
    """Write the merged model into `folder`; returns the largest output difference after reloading,
    or None for a model checked by names and shapes only. `lora` is the run's peft LoraConfig,
    `adapters` reads the checkpoint's adapter tensors by name."""
    import transformers
    from peft import inject_adapter_in_model

    code = remote_code(base, "model.pretrained")  # a folder naming code is refused here
    config = transformers.AutoConfig.from_pretrained(
        base, local_files_only=True, trust_remote_code=code
    )
    with building_empty(meta=True):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, trust_remote_code=code
        )
    aliases = _tie_groups(model)
    inject_adapter_in_model(lora, model, ADAPTER_NAME)
    trained = {n: t for n, t in model.state_dict(keep_vars=True).items() if ".lora_" in n}
    model.load_state_dict(adapters(trained), strict=False, assign=True)
    if untie_adapted(model):
        config.tie_word_embeddings = False
    layers = {
        f"{name}.weight": m for name, m in model.named_modules() if hasattr(m, "get_delta_weight")
    }
    meta = {
        n.replace(".base_layer.", "."): t
        for n, t in safetensors_io.tensors_to_write(model).items()
        if ".lora_" not in n
    }
    small = sum(4 * math.prod(t.shape) for t in meta.values()) <= reload.OUTPUTS_CHECKED_UP_TO
    outputs = expected() if small else []
    gc.collect()
    read = _merged_reader(base, aliases, layers)
    _write_folder(base, config, folder, meta, read, dtype)
    safetensors_io.check_weights(folder, meta, read, dtype)
    if not small:
        reload.check_names(folder, meta, dtype)
        return None
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, trust_remote_code=remote_code(folder, "export")
    )
    return rebuild.verify_against(outputs, reloaded, run, folder)


def untie_adapted(model: nn.Module) -> list[str]:
    """Give each adapted layer's base weight that another parameter shares a copy of its own;
    returns the layers untied."""
    shared: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        shared[id(param)] = shared.get(id(param), 0) + 1
    untied = []
    for name, module in model.named_modules():
        if hasattr(module, "get_delta_weight"):
            base = module.get_base_layer()
            if shared.get(id(base.weight), 0) > 1:
                base.weight = nn.Parameter(base.weight.detach().clone(), requires_grad=False)
                untied.append(name)
    return untied


def _tie_groups(model: nn.Module) -> dict[str, list[str]]:
    """Each tensor's name, and every name it is tied to: a folder holds one of them."""
    by_id: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _merged_reader(
    base: Path, aliases: dict[str, list[str]], layers: dict[str, Any]
) -> safetensors_io.Reader:
    """The merged model's tensors, read from the base folder a group at a time."""
    from safetensors import safe_open

    files = safetensors_files(base)
    index = base / "model.safetensors.index.json"
    where = json.loads(index.read_text())["weight_map"] if index.is_file() else {}
    if not where:
        with safe_open(base / files[0], "pt") as f:
            where = dict.fromkeys(f.keys(), files[0])

    def source(name: str) -> str:
        for candidate in [name, *aliases.get(name, [])]:
            if candidate in where:
                return candidate
        raise QgtrainError(
            f"export --merge: {base} holds no tensor {name}, which its config.json "
            "builds; give model.pretrained a folder as save_pretrained writes it"
        )

    @torch.no_grad()
    def read(wanted: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        with contextlib.ExitStack() as opened:
            sources = {name: source(name) for name in wanted}
            handles = {
                f: opened.enter_context(safe_open(base / f, "pt"))
                for f in sorted({where[s] for s in sources.values()})
            }
            for name, meta in wanted.items():
                tensor = handles[where[sources[name]]].get_tensor(sources[name])
                if tensor.is_floating_point():
                    tensor = tensor.to(meta.dtype)
                if name in layers:
                    tensor = tensor + layers[name].get_delta_weight(ADAPTER_NAME).to(tensor.dtype)
                out[name] = tensor
        return out

    return read


def _write_folder(
    base: Path,
    config: Any,
    folder: Path,
    meta: dict[str, torch.Tensor],
    read: safetensors_io.Reader,
    dtype: torch.dtype,
) -> None:
    """config.json and generation_config.json as save_pretrained writes them, then the weights."""
    import transformers

    config.dtype = dtype
    config.save_pretrained(folder)
    if (base / "generation_config.json").is_file():  # names no code; read as from_pretrained does
        generation = json.loads((base / "generation_config.json").read_text(encoding="utf-8"))
        transformers.GenerationConfig.from_dict(generation).save_pretrained(folder)
    size = writer.size_in_bytes(writer.SHARD_SIZE)
    safetensors_io.write_weights(folder, meta, read, dtype, size)
