"""The contract between qgtrain and a user's work: a Task names the model, the data and how to score
them.

A task is made by a function the config names (`task: package.module:function`), called on every
rank with the resolved RunConfig once the process group is up; it returns a Task. qgtrain owns
everything around it: sharding and resumable data order, the device move, DDP, mixed precision,
checkpoints, agreed stops, metrics exact over the whole split, early stopping, export. This module
imports neither torch nor the user's code, so the CLI stays fast on a login node.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

BUILTIN_LM = "qgtrain.tasks.causal_lm:causal_lm"


@dataclass
class Task:
    """What a task function returns.

    model: a torch.nn.Module, built on the CPU in fp32 (qgtrain moves and wraps it).
    train, val, test: map-style datasets (`len` and indexing: the data position of a run is a sample
        index, which is what makes resume exact). val and test may be None. train may instead be a
        torch IterableDataset (a stream) that yields this rank's and this loader worker's share;
        with state_dict()/load_state_dict() it resumes from its own saved position, without them
        by reading past what was consumed (data/stream/streams.py).
    collate: turns a list of samples into a batch (default: torch's default_collate). A batch may be
        a tensor, a dict, tuple, list or dataclass of them, or any object with its own
        `.to(device)`.
    loss: loss(model, batch) -> scalar tensor (default: `model(**batch).loss` for a dict batch, else
        `model(batch).loss`, as Hugging Face models compute it when given labels).
    metrics: metrics(model, batch) -> {name: (sum, count)} on validation and test batches; each is
        all-reduced over ranks and reported as val_<name> and test_<name> = sum / count.
    tokens: tokens(batch) -> how many tokens a batch holds, for tokens/s and tokens_seen. It is
        called on the batch as the loader gives it, before it moves to the device, so reading a
        tensor (a mask's sum) waits for no GPU. Without it only samples/s is reported.
    tokenizer: anything with save_pretrained (a Hugging Face tokenizer), exported beside the model.
    flops_per_sample: training FLOPs (forward and backward) per sample, for model FLOPs utilisation
        (`mfu` in the metrics, on GPUs whose peak is known).
    facts: small JSON-able facts about the model, saved in every checkpoint's model.json (export of
        the built-in causal LM reads its vocabulary, sequence length and tokenizer from them).
    optimizer: optimizer(model, optim_config) -> a torch.optim.Optimizer over the model's parameters
        (param groups, per-layer learning rates), instead of the one optim.name names. It is called
        with the model already on its device and sharded (fsdp). The schedule sets every group's
        rate each step, keeping a group's ratio to optim.lr as it was built (a group made with
        lr=optim.lr / 10 stays at a tenth).
    """

    model: Any
    train: Any
    val: Any = None
    test: Any = None
    collate: Callable[[list[Any]], Any] | None = None
    loss: Callable[[Any, Any], Any] | None = None
    metrics: Callable[[Any, Any], Mapping[str, tuple[Any, Any]]] | None = None
    tokens: Callable[[Any], int] | None = None
    tokenizer: Any = None
    flops_per_sample: float | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    optimizer: Callable[[Any, Any], Any] | None = None


@dataclass(kw_only=True)
class ReadyTask(Task):
    """A Task as qgtrain trains it: checked, with collate and loss filled in (tasks/build.py makes
    it)."""

    collate: Callable[[list[Any]], Any]
    loss: Callable[[Any, Any], Any]
