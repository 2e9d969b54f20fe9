"""Chat and instruction records turned into token ids and the mask of the tokens the loss counts.

A chat record's messages are rendered with the tokenizer's own chat template, so the model is
trained on exactly the text it will be prompted with. The loss counts the assistant's tokens only:
the template's `{% generation %}` marks say which they are where it has them; otherwise each
answer's span is found by rendering the conversation up to it (with the generation prompt) and up to
its end, which works for every template whose rendering of a prefix is a prefix of the whole, token
for token. A prompt_completion record is a user turn and an assistant turn where the tokenizer has a
chat template; without one it is the prompt's tokens, then the completion's and the end-of-text
token, which the loss counts (each tokenized on its own, so the answer begins at a token boundary).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..config import DataConfig
from ..foundation.errors import ConfigError
from ..foundation.folder_code import remote_code
from . import tokenizer

ROLES = ("system", "user", "assistant", "tool")
GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")
Sample = tuple[np.ndarray, np.ndarray]  # token ids (int64), and whether the loss counts each (bool)
Render = Callable[[dict[str, Any], str], Sample]


def fields(data: DataConfig) -> tuple[str, ...]:
    return (
        (data.messages_field,)
        if data.format == "chat"
        else (data.prompt_field, data.completion_field)
    )


def renderer(data: DataConfig, eos_id: int) -> Render:
    """How a record of data.format becomes a sample, for the tokenizer of data.tokenizer."""
    has_template = data.tokenizer != tokenizer.BYTE and template_of(data.tokenizer) is not None
    if data.format == "chat" and not has_template:
        raise ConfigError(
            f"data.tokenizer: {data.tokenizer} has no chat template (chat_template in "
            "tokenizer_config.json or chat_template.jinja); data.format: chat needs one, "
            "or use data.format: prompt_completion"
        )
    if not has_template:
        return lambda row, where: _concatenated(data, eos_id, row, where)
    from transformers import AutoTokenizer

    code = remote_code(data.tokenizer, "data.tokenizer")  # a folder naming code is refused here
    tok = AutoTokenizer.from_pretrained(data.tokenizer, trust_remote_code=code)
    marked = GENERATION.search(str(tok.chat_template)) is not None
    spans = _marked if marked else _by_prefixes

    def render(row: dict[str, Any], where: str) -> Sample:
        return spans(tok, _conversation(data, row, where), where, data)

    return render


_renderers: dict[str, Render] = {}  # a process's renderer, made once for its many records


def process_renderer(data: DataConfig, eos_id: int) -> Render:
    """This process's renderer (a preparation worker's, a stream's loader worker's): the tokenizer
    is loaded once per process, not per batch of records."""
    key = repr((data, eos_id))
    if key not in _renderers:
        _renderers.clear()
        _renderers[key] = renderer(data, eos_id)
    return _renderers[key]


def render_batch(
    data: DataConfig, eos_id: int, records: list[tuple[dict[str, Any], str]]
) -> list[Sample]:
    """Records rendered in a preparation worker (prepare_chat.py): each one's (ids, trained). It
    lives here, beside the renderer, so a worker imports neither torch nor the cache's layout (a
    tokenizer without a template starts in a fraction of a second)."""
    render = process_renderer(data, eos_id)
    return [render(row, where) for row, where in records]


def template_of(folder: str) -> str | None:
    """The folder's chat template, read as transformers reads it, without importing it."""
    jinja = Path(folder, "chat_template.jinja")
    if jinja.is_file():
        return jinja.read_text()
    config = Path(folder, "tokenizer_config.json")
    found = json.loads(config.read_text()).get("chat_template") if config.is_file() else None
    return json.dumps(found) if isinstance(found, list) else found


def _conversation(data: DataConfig, row: dict[str, Any], where: str) -> list[dict[str, str]]:
    if data.format == "prompt_completion":
        prompt, completion = (_text(row, name, where) for name in fields(data))
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
    name = data.messages_field
    if name not in row:
        raise ConfigError(
            f"{where}: no field '{name}' (fields there: {', '.join(map(str, row))}); "
            "set data.messages_field"
        )
    messages = row[name]
    if not isinstance(messages, list) or not messages:
        raise ConfigError(
            f"{where}: '{name}' holds {type(messages).__name__}, not a list of "
            "messages ({role, content})"
        )
    for index, message in enumerate(messages):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("content"), str)
            or not isinstance(message.get("role"), str)
        ):
            raise ConfigError(
                f"{where}: message {index} is not an object with 'role' and 'content' "
                f"text (got {json.dumps(message)[:80]})"
            )
        if message["role"] not in ROLES:
            raise ConfigError(
                f"{where}: message {index} has the unknown role "
                f"'{message['role']}'; allowed: {', '.join(ROLES)}"
            )
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _text(row: dict[str, Any], name: str, where: str) -> str:
    if name not in row:
        raise ConfigError(
            f"{where}: no field '{name}' (fields there: {', '.join(map(str, row))}); "
            "set data.prompt_field and data.completion_field"
        )
    if not isinstance(row[name], str):
        raise ConfigError(f"{where}: field '{name}' holds {type(row[name]).__name__}, not text")
    return str(row[name])


def _concatenated(data: DataConfig, eos_id: int, row: dict[str, Any], where: str) -> Sample:
    prompt, completion = (_text(row, name, where) for name in fields(data))
    asked = tokenizer.encode_pieces(data.tokenizer, eos_id, [prompt], [False])
    answer = tokenizer.encode_pieces(data.tokenizer, eos_id, [completion], [True])
    ids = np.concatenate([asked, answer]).astype(np.int64)
    return ids, np.arange(len(ids)) >= len(asked)


def _marked(tok: Any, messages: list[dict[str, str]], where: str, data: DataConfig) -> Sample:
    out = tok.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids = np.asarray(out["input_ids"], dtype=np.int64)
    trained = np.asarray(out["assistant_masks"], dtype=bool)
    answers = any(m["role"] == "assistant" and m["content"] for m in messages)
    if answers and not trained.any():  # marks the renderer did not reach: find the spans instead
        return _by_prefixes(tok, messages, where, data)
    return ids, trained


def _by_prefixes(tok: Any, messages: list[dict[str, str]], where: str, data: DataConfig) -> Sample:
    def ids(part: list[dict[str, str]], prompt: bool) -> list[int]:
        text = tok.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)
        return list(tok(text, add_special_tokens=False)["input_ids"])

    whole = ids(messages, False)
    trained = np.zeros(len(whole), dtype=bool)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        asked, answered = ids(messages[:index], True), ids(messages[: index + 1], False)
        if answered[: len(asked)] != asked or whole[: len(answered)] != answered:
            raise ConfigError(
                f"data.tokenizer: the chat template of {data.tokenizer} cannot mark the "
                f"assistant's tokens for data.format: {data.format}: it has no "
                "{% generation %} marks, and rendering the conversation up to an answer is not "
                f"a prefix of the whole ({where})"
            )
        trained[len(asked) : len(answered)] = True
    return np.asarray(whole, dtype=np.int64), trained
