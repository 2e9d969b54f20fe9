"""The downstream tasks of eval.tasks, scored on every rank: in the loop beside validation, and by
`qgtrain eval` on a finished run's checkpoints or an export.

Each rank scores the items i with i % world_size == rank; what it counts (right answers, items,
loss sums) is all-reduced, so the figures do not depend on the world size (up to the order of a
floating-point sum). Greedy decoding and argmax choices make them deterministic. The first
eval.samples outputs of a generate task are gathered on rank 0, which writes them to
<run>/eval/step-<N>.jsonl (and to TensorBoard as text through the caller's sink).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import EvalConfig, RunConfig
from ..data import tokenizer
from ..foundation.errors import ConfigError
from ..foundation.files import write_atomic
from ..runtime import objects
from ..runtime.rendezvous import DistEnv
from ..training.parallel.compiling import run_eager
from ..training.parallel.strategy import Strategy
from . import scoring
from .items import Choice, EvalTask, Prompt, Text, read_tasks

# rank 0 hands each step's samples on: (step, task name, [{prompt, output, answer}, ...])
SampleSink = Callable[[int, str, list[dict[str, Any]]], None]


class Downstream:
    def __init__(
        self,
        tasks: list[EvalTask],
        model: scoring.Model,
        cfg: EvalConfig,
        env: DistEnv,
        samples_dir: Path | None,
        sink: SampleSink | None = None,
    ) -> None:
        self.tasks, self.model, self.cfg, self.env = tasks, model, cfg, env
        self.samples_dir, self.sink = samples_dir, sink

    def evaluate(self, step: int, only: set[str] | None = None) -> dict[str, float | None]:
        """eval_<task>_<metric> of every task (of those named in `only`), the same on every rank; a
        collective."""
        was_training = self.model.module.training
        self.model.module.eval()
        try:
            metrics: dict[str, float | None] = {}
            samples: dict[str, list[dict[str, Any]]] = {}
            with run_eager(self.model.module):
                for task in self.tasks:
                    if only is None or task.name in only:
                        metrics.update(self._score(task, samples))
        finally:
            self.model.module.train(was_training)
        if samples:
            self._keep_samples(step, samples)
        return metrics

    def _score(
        self, task: EvalTask, samples: dict[str, list[dict[str, Any]]]
    ) -> dict[str, float | None]:
        share = task.items[self.env.rank :: self.env.world_size]
        if task.kind == "multiple_choice":
            counts = self._choices([item for item in share if isinstance(item, Choice)])
            correct, correct_norm, items = _summed(counts, self.model.device)
            return {
                f"eval_{task.name}_acc": correct / items,
                f"eval_{task.name}_acc_norm": correct_norm / items,
            }
        if task.kind == "generate":
            prompts = [item for item in share if isinstance(item, Prompt)]
            outputs = scoring.generate(
                self.model, [p.prompt for p in prompts], self.cfg.max_new_tokens, self.cfg.stop
            )
            matched = sum(
                p.answer is not None and o.strip() == p.answer.strip()
                for p, o in zip(prompts, outputs)
            )
            answered = sum(p.answer is not None for p in prompts)
            matches, asked = _summed([float(matched), float(answered)], self.model.device)
            samples[task.name] = self._first_samples(prompts, outputs)
            return {f"eval_{task.name}_exact_match": matches / asked if asked else None}
        texts = [item.text for item in share if isinstance(item, Text)]
        total, count = _summed(
            list(map(float, scoring.text_loss(self.model, texts))), self.model.device
        )
        loss = total / count if count else None
        return {
            f"eval_{task.name}_loss": loss,
            f"eval_{task.name}_ppl": math.exp(loss) if loss is not None else None,
        }

    def _choices(self, items: list[Choice]) -> list[float]:
        """[right by log-likelihood, right by log-likelihood per character (lm-eval's acc_norm),
        items] of this rank's share."""
        pairs = [
            scoring.continuation_pair(self.model, item.context, choice)
            for item in items
            for choice in item.choices
        ]
        scores = iter(scoring.log_likelihoods(self.model, pairs))
        correct = correct_norm = 0
        for item in items:
            own = [next(scores) for _ in item.choices]
            normed = [s / len(c) for s, c in zip(own, item.choices)]
            correct += _first_best(own) == item.label
            correct_norm += _first_best(normed) == item.label
        return [float(correct), float(correct_norm), float(len(items))]

    def _first_samples(self, prompts: list[Prompt], outputs: list[str]) -> list[dict[str, Any]]:
        """This rank's outputs among the task's first eval.samples prompts, with their index."""
        world, rank = self.env.world_size, self.env.rank
        return [
            {"index": rank + k * world, "prompt": p.prompt, "output": o, "answer": p.answer}
            for k, (p, o) in enumerate(zip(prompts, outputs))
            if rank + k * world < self.cfg.samples
        ]

    def _keep_samples(self, step: int, samples: dict[str, list[dict[str, Any]]]) -> None:
        everyone = (
            objects.all_gather(samples, what="generated samples")
            if dist.is_initialized() and dist.get_world_size() > 1
            else [samples]
        )
        if not self.env.is_main:
            return
        rows = []
        for name in samples:
            gathered = sorted(
                (s for each in everyone for s in each[name]), key=lambda s: s["index"]
            )
            rows += [{"task": name, **s} for s in gathered]
            if self.sink is not None:
                self.sink(step, name, gathered)
        if self.samples_dir is not None:
            self.samples_dir.mkdir(mode=0o700, exist_ok=True)
            text = "".join(json.dumps(row) + "\n" for row in rows)
            write_atomic(self.samples_dir / f"step-{step}.jsonl", text)


def downstream_for(
    cfg: RunConfig,
    module: torch.nn.Module,
    facts: dict[str, Any],
    strategy: Strategy,
    precision: str,
    samples_dir: Path | None,
    sink: SampleSink | None = None,
) -> Downstream | None:
    """The run's downstream tasks on `module` as `strategy` holds it, in `precision` (None without
    eval.tasks), its text tokenized as the run's data was (`facts`: the built-in task's tokenizer,
    end-of-text token and window)."""
    if not cfg.eval.tasks:
        return None
    spec = facts.get("tokenizer")
    if not spec:
        raise ConfigError(
            "eval.tasks: the run's data has no tokenizer to write the tasks' text with (data "
            "from data.factory); use data.name corpus, files or synthetic, or remove eval.tasks"
        )
    model = scoring.Model(
        module,
        tokenizer.load(spec),
        facts.get("eos_id"),
        int(facts.get("seq_len") or cfg.data.seq_len),
        strategy.device,
        strategy.autocast_precision(precision),
        cfg.eval.batch_size,
        strategy.evaluates_in_lockstep,
        facts.get("vocab_size"),
        scoring.cache_argument(module),
    )
    tasks = read_tasks(cfg.eval.tasks, cfg.eval.max_items)
    _refuse_choices_longer_than_the_window(tasks, model)
    return Downstream(tasks, model, cfg.eval, strategy.env, samples_dir, sink)


def _refuse_choices_longer_than_the_window(tasks: list[EvalTask], model: scoring.Model) -> None:
    """A choice is scored whole, its context cut from the left to fit the window with it (as lm-eval
    cuts it); a choice longer than the window on its own cannot be scored at all. Refused when the
    run starts, naming the first such item and the window that would score them all, rather than
    stopping the run at its first validation."""
    lengths = [
        (item.where, len(scoring.continuation_pair(model, item.context, choice)[1]))
        for task in tasks
        for item in task.items
        if isinstance(item, Choice)
        for choice in item.choices
    ]
    too_long = [(where, length) for where, length in lengths if length > model.window]
    if too_long:
        where, length = too_long[0]
        raise ConfigError(
            f"eval.tasks: {where}: a choice of {length} tokens, longer than the {model.window} "
            "tokens the model sees (data.seq_len): a choice is scored whole, only its context is "
            f"cut to fit. HINT: data.seq_len {max(n for _, n in too_long)} or more scores all "
            f"{len(too_long)} such choice(s) of eval.tasks; or shorten or leave out those items"
        )


def _first_best(scores: list[float]) -> int:
    """The index of the highest score, the first among equals (as numpy's argmax)."""
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def _summed(values: list[float], device: torch.device) -> list[float]:
    """The values added up over every rank."""
    total = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(total)
    return [float(v) for v in total.tolist()]
