"""How the built-in language model is built beyond model.*: as fast as its shape allows for a new
run, and as it began for a resumed one.

A new run's model (issue 47) gets:
- the fused tanh GELU: an architecture whose activation is transformers' `gelu_new` (a Python
  formula: many small kernels in eager mode) gets `gelu_pytorch_tanh`, the same tanh approximation
  as one kernel;
- its embedding and LM head padded to a multiple of 64 rows, as nanoGPT pads 50257 to 50304 (matrix
  products want such sizes). The extra rows are never predicted: the model's forward cuts its
  logits to the real vocabulary (`_cut_to_vocab`), so the loss, every metric, generation and a loss
  asked for with `labels` see real tokens only, and an export writes the real rows only
  (ops/export/rebuild.py). A LoRA run's base is not padded: peft merges it into the export whole;
- SDPA attention, where transformers has it for the architecture;
- its weights drawn once. torch's layer constructors initialise every parameter, then transformers'
  init draws each one again; here the constructors' init functions fill NaN instead (nothing drawn)
  and transformers' init draws the weights on the CPU from the seeded generator, so a seed gives the
  same weights whatever device trains them. A model left holding a NaN (an architecture whose init
  misses a tensor) is built again the full way from the same generator state.

A run keeps the model it began with: the choices are the task's facts (model.json in every
checkpoint), and a resumed run is built from its checkpoint's (`resuming`, set by tasks/build.py).
Facts without them, written before, give the model as it was built then (`from_facts` of them is
LEGACY): gelu_new, the vocabulary unpadded, transformers' default attention, the weights drawn twice
(a LoRA run's frozen base is drawn again on every start, so its values must not change either).
So does the training forward's key/value cache, for any model the built-in task trains: a new run
asks for none, a run begun before keeps transformers' default (`keeps_default_cache`).
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import ModelConfig
from ..state import layout
from ..state.manifest_files import read_regular
from .empty_weights import is_building_empty

VOCAB_MULTIPLE = 64
SLOW_GELU, FUSED_GELU = "gelu_new", "gelu_pytorch_tanh"
SDPA = "sdpa"
# where transformers' configs name their activation
ACTIVATION_KEYS = ("activation_function", "hidden_act", "hidden_activation")
# what transformers' loss functions take beside logits and labels
LOSS_KWARGS = ("num_items_in_batch", "ignore_index", "shift_labels")
FACTS_ATTRIBUTE = "_qgtrain_lm_facts"
CUT_ATTRIBUTE = "_qgtrain_vocab_cut"
TRAINING_CACHE = "training_cache"  # the task's fact: does the training forward build a KV cache


@dataclass(frozen=True)
class LMShape:
    activation: str | None  # set on the architecture's activation key; None: its own default
    fused_gelu: bool  # gelu_new becomes gelu_pytorch_tanh
    vocab_rows: int | None  # the embedding's rows as recorded; None: rounded up to vocab_multiple
    vocab_multiple: int
    attention: str | None  # transformers' attn_implementation; None: its default
    init_once: bool

    def rows(self, vocab_size: int) -> int:
        multiple = self.vocab_multiple
        return self.vocab_rows or -(-vocab_size // multiple) * multiple


NEW = LMShape(None, True, None, VOCAB_MULTIPLE, SDPA, True)
LEGACY = LMShape(None, False, None, 1, None, False)
_RESUMED: ContextVar[Mapping[str, Any] | None] = ContextVar("resumed_model_facts", default=None)


def new_shape(model: ModelConfig) -> LMShape:
    return NEW if model.adapter == "none" else LMShape(None, True, None, 1, SDPA, True)


def from_facts(facts: Mapping[str, Any]) -> LMShape:
    """The shape a checkpoint's model facts record; LEGACY where they record none."""
    return LMShape(
        activation=facts.get("activation"),
        fused_gelu=False,
        vocab_rows=facts.get("padded_vocab"),
        vocab_multiple=1,
        attention=facts.get("attention"),
        init_once=facts.get("init") == "once",
    )


@contextlib.contextmanager
def resuming(facts: Mapping[str, Any] | None) -> Iterator[None]:
    """While a task is built: the model facts of the checkpoint the run resumes from (None: a new
    run). A task function takes the config alone, so the built-in task reads them here (for_run)."""
    token = _RESUMED.set(facts)
    try:
        yield
    finally:
        _RESUMED.reset(token)


def for_run(model: ModelConfig) -> LMShape:
    """A new run's shape, or the resumed checkpoint's."""
    facts = _RESUMED.get()
    return new_shape(model) if facts is None else from_facts(facts)


def keeps_default_cache() -> bool:
    """Whether the training forward keeps transformers' default key/value cache (models.lm_loss):
    only in a run resumed from a checkpoint whose facts predate TRAINING_CACHE."""
    facts = _RESUMED.get()
    return facts is not None and facts.get(TRAINING_CACHE, True) is not False


def saved_facts(checkpoint_dir: Path) -> dict[str, Any]:
    """A checkpoint's model facts (model.json); none for a checkpoint without them."""
    path = checkpoint_dir / layout.MODEL_FACTS
    return json.loads(read_regular(path)) if path.is_file() else {}


def facts_of(model: nn.Module) -> dict[str, Any]:
    """What `built` recorded of the model it built: none for a pretrained or factory model."""
    return dict(getattr(model, FACTS_ATTRIBUTE, {}))


def built(config: Any, shape: LMShape, vocab_size: int) -> nn.Module:
    """transformers' causal LM of `config` (its vocab_size already shape.rows), built as `shape`
    says; ValueError where transformers has no causal LM for it."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise ValueError(f"no causal-LM class for {type(config).__name__}") from None
    key = next((k for k in ACTIVATION_KEYS if isinstance(getattr(config, k, None), str)), None)
    if key and shape.activation:
        setattr(config, key, shape.activation)
    elif key and shape.fused_gelu and getattr(config, key) == SLOW_GELU:
        setattr(config, key, FUSED_GELU)
    attention = shape.attention
    if attention == SDPA and not getattr(cls, "_supports_sdpa", False):
        attention = None
    options = {"attn_implementation": attention} if attention else {}
    drawn_from = torch.get_rng_state()
    init = "full"
    if shape.init_once:
        with _constructors_draw_nothing():
            model = transformers.AutoModelForCausalLM.from_config(config, **options)
        init = "once"
        if not is_building_empty() and any(bool(p.isnan().any()) for p in model.parameters()):
            torch.set_rng_state(drawn_from)
            init = "full"
    if init == "full":
        model = transformers.AutoModelForCausalLM.from_config(config, **options)
    rows = shape.rows(vocab_size)
    if rows > vocab_size:
        cut = _cut_to_vocab(vocab_size)
        setattr(model, CUT_ATTRIBUTE, (cut, model.register_forward_hook(cut, with_kwargs=True)))
    facts = {
        "activation": getattr(config, key) if key else None,
        "padded_vocab": rows,
        "attention": model.config._attn_implementation,
        "init": init,
    }
    setattr(model, FACTS_ATTRIBUTE, facts)
    return model


def cut_after_wrappers(model: nn.Module) -> None:
    """Moves the vocabulary cut behind the forward hooks a wrapper added since the build. FSDP2's
    post-forward hook registers its pre-backward hook on every output tensor and warns that a view
    could lose it to an in-place op; the cut logits are such a view. Run after FSDP's hook, the cut
    hands FSDP the logits the LM head computed, and the view's gradient still reaches them."""
    installed = getattr(model, CUT_ATTRIBUTE, None)
    if installed is not None:
        cut, handle = installed
        handle.remove()
        setattr(model, CUT_ATTRIBUTE, (cut, model.register_forward_hook(cut, with_kwargs=True)))


@contextlib.contextmanager
def _constructors_draw_nothing() -> Iterator[None]:
    """torch's init functions, where its layers and transformers' modules bind them (transformers'
    own list), fill NaN: transformers' init (guard_torch_init_functions) swaps in the real ones
    while it draws."""
    from transformers import initialization

    def nan_fill(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if tensor.is_floating_point():
            with torch.no_grad():
                tensor.fill_(math.nan)
        return tensor

    kept: dict[tuple[Any, str], Any] = {}
    for name in initialization.TORCH_MODULES_TO_PATCH:
        module = sys.modules.get(name)
        for function in initialization.TORCH_INIT_FUNCTIONS if module else ():
            if hasattr(module, function):
                kept[module, function] = getattr(module, function)
                setattr(module, function, nan_fill)
    try:
        yield
    finally:
        for (module, function), original in kept.items():
            setattr(module, function, original)


def _cut_to_vocab(vocab_size: int) -> Callable[..., Any]:
    """A forward hook: the logits of the real vocabulary only, and a loss asked for with `labels`
    computed over them (transformers computed it over the padded rows)."""

    def cut(module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        labels = kwargs.get("labels")
        if hasattr(output, "logits"):
            output.logits = output.logits[..., :vocab_size]
            if labels is not None:
                output.loss = _loss(module, output.logits, labels, kwargs)
            return output
        if isinstance(output, tuple):  # return_dict=False: ((loss,) logits, ...)
            at = 0 if labels is None else 1
            logits = output[at][..., :vocab_size]
            loss = () if labels is None else (_loss(module, logits, labels, kwargs),)
            return (*loss, logits, *output[at + 1 :])
        return output

    return cut


def _loss(
    module: nn.Module, logits: torch.Tensor, labels: torch.Tensor, kwargs: dict[str, Any]
) -> torch.Tensor:
    options = {name: kwargs[name] for name in LOSS_KWARGS if name in kwargs}
    loss_function: Callable[..., torch.Tensor] = getattr(module, "loss_function")
    return loss_function(logits, labels, vocab_size=logits.shape[-1], **options)
