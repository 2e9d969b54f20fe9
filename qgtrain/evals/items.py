"""A downstream task's items, read from the user's jsonl files and checked line by line.

Reading is the same on every rank (the files are read whole, in the order the patterns name them),
so every rank knows every item and takes its own share by index. A line that does not fit its
kind stops the run before any scoring, in one line naming the file and line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..data.files import sources
from ..foundation.errors import ConfigError


@dataclass(frozen=True)
class Choice:
    """multiple_choice: each choice follows the context as written (HellaSwag's endings begin with
    their space), scored by its log-likelihood after the context."""

    context: str
    choices: tuple[str, ...]
    label: int
    # file:line, for a refusal that names the item; not part of what it is (nor of its digest)
    where: str = field(default="", compare=False, repr=False)


@dataclass(frozen=True)
class Prompt:
    """generate: greedy decoding from the prompt; the answer, where given, is what exact match
    compares the output with."""

    prompt: str
    answer: str | None


@dataclass(frozen=True)
class Text:
    """perplexity: every token of the text predicted from those before it."""

    text: str


Item = Choice | Prompt | Text


@dataclass(frozen=True)
class EvalTask:
    name: str
    kind: str
    items: tuple[Item, ...]


def read_tasks(tasks: tuple[dict[str, Any], ...], max_items: int) -> list[EvalTask]:
    """Every configured task with its items (the first `max_items` of each, 0 = all)."""
    return [_read_task(index, spec, max_items) for index, spec in enumerate(tasks)]


def _read_task(index: int, spec: dict[str, Any], max_items: int) -> EvalTask:
    key = f"eval.tasks[{index}].files"
    files = [spec["files"]] if isinstance(spec["files"], str) else list(spec["files"])
    read = _ITEM_OF[spec["kind"]]
    items: list[Item] = []
    for source in sources.find(files, key):
        if source.kind != "jsonl":
            raise ConfigError(f"{key}: {source.path} is not a .jsonl file (one JSON object a line)")
        for row, where, _ in sources.records(source, ()):
            items.append(read(row, where))
            if max_items and len(items) == max_items:
                return EvalTask(spec["name"], spec["kind"], tuple(items))
    if not items:
        raise ConfigError(
            f"{key}: {', '.join(files)} hold no items; task {spec['name']!r} is empty"
        )
    return EvalTask(spec["name"], spec["kind"], tuple(items))


def _choice(row: dict[str, Any], where: str) -> Choice:
    context, choices, label = _text(row, "context", where), row.get("choices"), row.get("label")
    if (
        not isinstance(choices, list)
        or len(choices) < 2
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise ConfigError(
            f"{where}: 'choices' must be a list of two or more non-empty strings, got "
            f"{str(choices)[:60]}"
        )
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
        raise ConfigError(
            f"{where}: 'label' must be the index of the right choice, 0 to {len(choices) - 1}, "
            f"got {label!r}"
        )
    return Choice(context, tuple(choices), label, where)


def _prompt(row: dict[str, Any], where: str) -> Prompt:
    answer = row.get("answer")
    if answer is not None and not isinstance(answer, str):
        raise ConfigError(f"{where}: 'answer' must be text, got {type(answer).__name__}")
    return Prompt(_text(row, "prompt", where), answer)


def _perplexity_text(row: dict[str, Any], where: str) -> Text:
    return Text(_text(row, "text", where))


def _text(row: dict[str, Any], field: str, where: str) -> str:
    value = row.get(field)
    if not isinstance(value, str) or not value:
        raise ConfigError(
            f"{where}: expected a non-empty text field {field!r}, got "
            f"{'nothing' if value is None else type(value).__name__}"
        )
    return value


_ITEM_OF: dict[str, Callable[[dict[str, Any], str], Item]] = {
    "multiple_choice": _choice,
    "generate": _prompt,
    "perplexity": _perplexity_text,
}
