"""One value of a config file or a `--set` override turned into its field's type: a choice, text,
a mapping, a list, a boolean or a number within the field's bounds, or a ConfigError that names
where it came from, what was found and what is allowed. load.py reads the files and calls it
once a field.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal

import yaml

from ..foundation.errors import ConfigError

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


def did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""


def describe(value: Any) -> str:
    kind = {dict: "a mapping", list: "a list", bool: "a boolean", str: "text"}.get(
        type(value), type(value).__name__
    )
    return f"{kind} ({value!r})" if not isinstance(value, (dict, list)) else kind


def convert(
    raw: Any, hint: Any, spec: dataclasses.Field[Any], where: str, *, from_text: bool
) -> Any:
    """Convert one value to the field's type, or raise a ConfigError saying what is allowed."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if type(None) in args and (
            raw is None or (from_text and str(raw).strip().lower() in ("null", "none", "~", ""))
        ):
            return None
        hint, named = _number_or_word([a for a in args if a is not type(None)])
        if named:  # a word beside a number: local_every_steps: auto
            return _to_word_or_number(raw, named, hint, spec, where, from_text)
    if typing.get_origin(hint) is Literal:
        return _to_choice(raw, args, where, from_text)
    if hint is bool:
        return _to_bool(raw, where, from_text)
    if hint is int or hint is float:
        return _to_number(raw, hint, spec, where, from_text)
    if hint is str:
        return _to_text(raw, spec, where)
    if typing.get_origin(hint) is dict:
        return _to_mapping(raw, where, from_text)
    if typing.get_origin(hint) is tuple:
        return _to_list(raw, args[0], where, from_text)
    raise AssertionError(f"unsupported config type {hint!r} for {where}")


def _number_or_word(options: list[Any]) -> tuple[Any, tuple[str, ...]]:
    """A union's type (X of `X | None`), or for `int | Literal["auto"]` the number and its
    words, with no words for the first."""
    if len(options) == 1:
        return options[0], ()
    (words,) = [a for a in options if typing.get_origin(a) is Literal]
    (number,) = [a for a in options if a is not words]
    return number, typing.get_args(words)


def _to_word_or_number(
    raw: Any,
    words: tuple[str, ...],
    kind: type,
    spec: dataclasses.Field[Any],
    where: str,
    from_text: bool,
) -> Any:
    if isinstance(raw, str) and raw.strip() in words:
        return raw.strip()
    try:
        return _to_number(raw, kind, spec, where, from_text)
    except ConfigError:
        noun = "an integer" if kind is int else "a number"
        raise ConfigError(
            f"{where}: expected {' or '.join(words)}, or {noun}{_bounds(spec)}; got {describe(raw)}"
        ) from None


def _to_choice(raw: Any, choices: tuple[Any, ...], where: str, from_text: bool) -> Any:
    """A choice among text and booleans (model.compile: auto, true, false): `--set` gives text,
    YAML a boolean, and a number is never a boolean (1 == True in Python)."""
    text = str(raw).strip() if from_text else raw
    if True in choices and from_text and str(text).lower() in _TRUE | _FALSE:
        text = str(text).lower() in _TRUE
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = str(text)
    if text not in choices:
        raise ConfigError(
            f"{where}: {raw!r} is not allowed; choose one of "
            f"{', '.join(str(c).lower() if isinstance(c, bool) else c for c in choices)}."
            + did_you_mean(str(text), [str(a) for a in choices])
        )
    return text


def _to_text(raw: Any, spec: dataclasses.Field[Any], where: str) -> str:
    if raw is None and spec.default == "":  # YAML's null for an optional text: its empty default
        return ""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return str(raw)
    if not isinstance(raw, str):
        raise ConfigError(f"{where}: expected text, got {describe(raw)}")
    return raw


def _to_mapping(raw: Any, where: str, from_text: bool) -> dict[str, Any]:
    if from_text and isinstance(raw, str):
        raw = parse_yaml_text(raw, where)
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise ConfigError(
            f"{where}: expected a mapping of names to values, e.g. {{hidden: 64}}, got "
            f"{describe(raw)}"
        )
    return dict(raw)


def _to_list(raw: Any, item: Any, where: str, from_text: bool) -> tuple[Any, ...]:
    """A list of text items, of integers (train.skip_steps) or of mappings (data.mix: its rules)."""
    if from_text:
        raw = parse_yaml_text(str(raw), where)
    kind, wrong = _list_items(item)
    if not isinstance(raw, list) or any(map(wrong, raw)):
        raise ConfigError(f"{where}: expected a list of {kind}, got {describe(raw)}")
    return tuple(raw) if item is int or typing.get_origin(item) is dict else tuple(map(str, raw))


def _list_items(item: Any) -> tuple[str, Any]:
    """How a list field's items are described, and the test of an item that is not one."""
    if item is int:
        return "integers, e.g. [120, 455]", lambda v: isinstance(v, bool) or not isinstance(v, int)
    if typing.get_origin(item) is dict:
        return "mappings, e.g. [{name: a}]", lambda v: not isinstance(v, dict)
    return "text items, e.g. ['--exclusive']", lambda v: isinstance(v, (dict, list)) or v is None


def _to_bool(raw: Any, where: str, from_text: bool) -> bool:
    if isinstance(raw, bool):
        return raw
    if from_text and str(raw).strip().lower() in _TRUE | _FALSE:
        return str(raw).strip().lower() in _TRUE
    raise ConfigError(f"{where}: expected true or false, got {describe(raw)}")


def _to_number(
    raw: Any, kind: type, spec: dataclasses.Field[Any], where: str, from_text: bool
) -> Any:
    noun = "an integer" if kind is int else "a number"
    value: Any = raw
    if isinstance(raw, str):  # from --set, or YAML's reading of 3e-4 or 1e3 (without a dot) as text
        value = _number_of_text(raw.strip().replace("_", ""), kind)
        if value is None:
            raise ConfigError(f"{where}: expected {noun}{_bounds(spec)}, got {describe(raw)}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected {noun}{_bounds(spec)}, got {describe(raw)}")
    if kind is int and isinstance(value, float):
        # written in a float's notation (1e3, 2.0): an integer only if it is a whole number
        if not (math.isfinite(value) and value.is_integer()):
            written = raw.strip() if isinstance(raw, str) else repr(raw)
            raise ConfigError(
                f"{where}: {written} is not an integer; expected an integer{_bounds(spec)}"
            )
    value = kind(value)
    low, high = spec.metadata.get("min"), spec.metadata.get("max")
    if (
        not math.isfinite(value)
        or (low is not None and value < low)
        or (high is not None and value > high)
    ):
        raise ConfigError(f"{where}: {value} is out of range; expected {noun}{_bounds(spec)}")
    return value


def _number_of_text(text: str, kind: type) -> int | float | None:
    """The number a text spells (an integer key's '1e3' as the float 1000.0, judged by the caller),
    or None for text that is no number."""
    for read in (int, float) if kind is int else (float,):
        try:
            return read(text)
        except ValueError:
            continue
    return None


def _bounds(spec: dataclasses.Field[Any]) -> str:
    low, high = spec.metadata.get("min"), spec.metadata.get("max")
    if low is not None and high is not None:
        return f" between {low} and {high}"
    if low is not None:
        return f" >= {low}"
    return f" <= {high}" if high is not None else ""


def parse_yaml_text(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(
            f"{where}: {text!r} is not a YAML value (quote text that holds ':' or '#')"
        ) from None
