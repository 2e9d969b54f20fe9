"""The eval section: downstream tasks scored beside validation and by `qgtrain eval` (evals/).

A task is {name, kind, files}: jsonl files of the user's own, read locally. Its name is its metrics'
key (eval_<name>_acc, ...), so names follow the rules of data.mix's source names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..foundation.task import BUILTIN_LM
from .fields import Problem, files_problem, name_problem, setting

if TYPE_CHECKING:
    from .run import RunConfig

TASK_KINDS = ("multiple_choice", "generate", "perplexity")
TASK_KEYS = {"name", "kind", "files"}
# what each kind reports, as eval_<name>_<metric>: what early_stopping.metric may name
KIND_METRICS = {
    "multiple_choice": ("acc", "acc_norm"),
    "generate": ("exact_match",),
    "perplexity": ("loss", "ppl"),
}


@dataclass(frozen=True)
class EvalConfig:
    tasks: tuple[dict[str, Any], ...] = setting(
        (),
        "downstream tasks, each {name, kind, files}: kind multiple_choice (jsonl lines "
        "{context, choices, label}: eval_<name>_acc, _acc_norm), generate ({prompt, answer}: "
        "eval_<name>_exact_match and samples) or perplexity ({text}: eval_<name>_loss, _ppl); "
        "run at every validation and at the end, and by qgtrain eval",
    )
    batch_size: int = setting(8, "sequences per forward of the downstream tasks", min=1)
    max_items: int = setting(0, "items of each task evaluated (0 = all)", min=0)
    max_new_tokens: int = setting(32, "generate: most tokens written per prompt", min=1)
    stop: tuple[str, ...] = setting(
        (), "generate: strings that end an output, cut from it (as lm-eval's until)"
    )
    samples: int = setting(
        4,
        "generate: the first prompts whose outputs are written to <run>/eval/step-<N>.jsonl "
        "and TensorBoard",
        min=0,
    )


def eval_rules(cfg: RunConfig) -> Problem:
    if cfg.eval.tasks and cfg.task.factory not in ("", None, BUILTIN_LM):
        return "eval.tasks", (
            f"score a causal language model (the built-in task's); {cfg.task.factory}'s own "
            "model has no tokenizer or generate to score them with. Report your own figures "
            "from Task.metrics (scored again on any checkpoint by `qgtrain eval RUN --split "
            "val,test`), or remove eval.tasks"
        )
    seen: set[str] = set()
    for index, task in enumerate(cfg.eval.tasks):
        if problem := _task_problem(f"eval.tasks[{index}]", task, seen):
            return problem
    if any(not text for text in cfg.eval.stop):
        return "eval.stop", "an empty string would end every output at once; remove it"
    return None


def _task_problem(where: str, task: object, seen: set[str]) -> Problem:
    if not isinstance(task, dict) or set(task) != TASK_KEYS:
        found = sorted(task) if isinstance(task, dict) else type(task).__name__
        return where, f"each task is {{name, kind, files}}, got {found}"
    name, kind, files = task["name"], task["kind"], task["files"]
    if problem := name_problem(where, "task", name, seen):
        return problem
    if kind not in TASK_KINDS:
        return f"{where}.kind", f"{kind!r} is not a kind; choose one of {', '.join(TASK_KINDS)}"
    return files_problem(where, f"task {name!r}", files, "jsonl files or globs")


def task_metrics(cfg: RunConfig) -> list[str]:
    """Every eval_<name>_<metric> the configured tasks report."""
    return [
        f"eval_{task['name']}_{metric}"
        for task in cfg.eval.tasks
        for metric in KIND_METRICS[task["kind"]]
    ]
