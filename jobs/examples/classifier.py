"""A transformers sequence classifier trained by qgtrain: which standard-library module is a snippet
from?

    qgtrain train --config config.yaml --config jobs/classifier.yaml
    qgtrain export runs/classifier --out models/classifier
    python -c 'from transformers import pipeline
    print(pipeline("text-classification", "models/classifier")("import json"))'

The model is `AutoModelForSequenceClassification` built from a small BERT config (no download); the
text comes from Python's own sources, so the data set is made here on any machine. The batch is a
dict with labels, so the loss is the model's own (`outputs.loss`, qgtrain's default); accuracy is
the metric.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

import qgtrain
from qgtrain.data.tokenizer import byte_level

MODULES = ("json", "asyncio", "unittest", "email")
PAD = "<pad>"


def snippets(module: str, lines: int = 6) -> list[str]:
    """Consecutive non-blank lines of the module's sources, in chunks."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = (
        sorted((root / module).rglob("*.py"))
        if (root / module).is_dir()
        else [root / f"{module}.py"]
    )
    text = [
        line
        for path in files
        for line in path.read_text(errors="replace").splitlines()
        if line.strip()
    ]
    return ["\n".join(text[i : i + lines]) for i in range(0, len(text) - lines, lines)]


class Snippets(Dataset):
    def __init__(self, items: list[tuple[str, int]]) -> None:
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[str, int]:
        return self.items[index]


def make_tokenizer(max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level: every text has a tokenization, and the exported folder carries it for
    pipeline()."""
    tok = byte_level()
    tok.add_special_tokens([PAD])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, model_max_length=max_length, padding_side="right"
    )


class Collate:
    """Texts to padded token ids, attention mask and labels: the dict the model takes as keyword
    arguments."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer

    def __call__(self, samples: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
        texts, labels = zip(*samples)
        encoded = self.tokenizer(list(texts), padding=True, truncation=True, return_tensors="pt")
        return {**encoded, "labels": torch.tensor(labels)}


def accuracy(
    model: torch.nn.Module, batch: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, int]]:
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    return {"accuracy": ((logits.argmax(-1) == batch["labels"]).sum(), len(batch["labels"]))}


def batch_tokens(batch: dict[str, torch.Tensor]) -> int:
    return batch["input_ids"].numel()


def snippet_classifier(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    """Options (task.options): per_module (snippets per module), max_length, hidden, layers."""
    options = {"per_module": 800, "max_length": 128, "hidden": 64, "layers": 2, **cfg.task.options}
    gen = torch.Generator().manual_seed(cfg.train.seed)
    items = []
    for label, module in enumerate(MODULES):
        found = snippets(module)
        picks = torch.randperm(len(found), generator=gen)[: options["per_module"]].tolist()
        items += [(found[i], label) for i in picks]
    order = torch.randperm(len(items), generator=gen).tolist()
    items = [items[i] for i in order]
    n_val = n_test = len(items) // 10
    tokenizer = make_tokenizer(options["max_length"])
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=options["hidden"],
        num_hidden_layers=options["layers"],
        num_attention_heads=2,
        intermediate_size=4 * options["hidden"],
        max_position_embeddings=options["max_length"],
        pad_token_id=tokenizer.pad_token_id,
        num_labels=len(MODULES),
        id2label=dict(enumerate(MODULES)),
        label2id={m: i for i, m in enumerate(MODULES)},
    )
    return qgtrain.Task(
        model=BertForSequenceClassification(config),
        train=Snippets(items[n_val + n_test :]),
        val=Snippets(items[:n_val]),
        test=Snippets(items[n_val : n_val + n_test]),
        collate=Collate(tokenizer),
        metrics=accuracy,
        tokens=batch_tokens,
        tokenizer=tokenizer,
    )
