"""Turning config files and `--set KEY=VALUE` overrides into a validated RunConfig, and back into YAML.

Later files override earlier ones key by key (config.yaml, then an overlay from jobs/), and `--set`
overrides them all. Every value is converted to its field's type here, so a mistake is reported with the
file (or `--set`) it came from, the key, what was found and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import yaml

from .config import SECTIONS, RunConfig, check_rules
from .errors import ConfigError, first_line

OPTIONS = "task.options"
_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


DEFAULT_FILE = Path("config.yaml")


def config_files(given: Iterable[str | Path] | str | Path | None) -> list[Path]:
    """The files to load: those given, else ./config.yaml where there is one (the README's `qgtrain train`
    in the repository), else none (the built-in defaults)."""
    if isinstance(given, (str, Path)):
        return [Path(given)]
    files = [Path(p) for p in given or ()]
    return files or ([DEFAULT_FILE] if DEFAULT_FILE.is_file() else [])


def load_config(paths: Iterable[str | Path] = (), sets: Iterable[str] = ()) -> RunConfig:
    """Load and validate config files (merged in order) and `--set` overrides (applied last)."""
    values: dict[str, tuple[Any, str]] = {}
    sources: list[str] = []
    for path in paths:
        values.update(_anchored(_flatten(_read_yaml(Path(path)), str(path)), Path(path).parent))
        sources.append(str(path))
    from_files = values.get(OPTIONS, ({}, ""))[0]
    parsed = _parse_sets(sets, dict(from_files) if isinstance(from_files, dict) else {})
    values.update(parsed)
    sources += ["--set"] if parsed else []
    return build_config(values, ", ".join(dict.fromkeys(sources)) or "defaults")


def _parse_sets(sets: Iterable[str], options: dict[str, Any] | None = None) -> dict[str, tuple[Any, str]]:
    """`--set KEY=VALUE` as (text, '--set') per dotted key; task.options.NAME=VALUE merge into `options`."""
    values: dict[str, tuple[Any, str]] = {}
    for assignment in sets:
        key, sep, text = assignment.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. --set train.max_steps=100")
        if key == "task":
            key = "task.factory"
        if key.startswith(OPTIONS + "."):  # one option of the user's task, merged into the others
            options = dict(options or {})
            options[key.removeprefix(OPTIONS + ".")] = _parse_yaml_text(text, f"--set {key}")
            values[OPTIONS] = (options, "--set")
        else:
            _check_key(key, "--set")
            values.update(_anchored({key: (text, "--set")}, Path.cwd()))
    return values


def _anchored(values: dict[str, tuple[Any, str]], base: Path) -> dict[str, tuple[Any, str]]:
    """A task, model or data function named as 'file.py:function' with a relative path is relative to the
    config file that names it (to the working directory for --set), and recorded absolute: a requeued
    job, an export or a run started elsewhere finds the same file."""
    for key in ("task.factory", "model.factory", "data.factory", "optim.name", "optim.schedule"):
        raw, origin = values.get(key, (None, ""))
        if isinstance(raw, str) and raw.count(":") == 1:
            file, function = raw.split(":")
            if file.endswith(".py") and not Path(file).is_absolute():
                values[key] = (f"{(base / file).resolve()}:{function}", origin)
    return values


def build_config(values: Mapping[str, tuple[Any, str]], source: str) -> RunConfig:
    """Build a RunConfig from dotted keys mapped to (raw value, where it came from)."""
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    for key, (raw, origin) in values.items():
        section, name = key.split(".", 1)
        spec = _field(section, name)
        hint = typing.get_type_hints(SECTIONS[section])[name]
        sections[section][name] = _convert(raw, hint, spec, f"{origin}: {key}", from_text=origin == "--set")
    cfg = RunConfig(**{name: SECTIONS[name](**kw) for name, kw in sections.items()})
    check_rules(cfg, source)
    return cfg


def with_overrides(cfg: RunConfig, sets: Iterable[str]) -> RunConfig:
    """A resolved config with `--set KEY=VALUE` overrides applied, validated once more as a whole."""
    values = _flatten(config_to_dict(cfg), "the given config")
    values.update(_parse_sets(sets, dict(cfg.task.options)))
    return build_config(values, "the given config, --set")


def config_to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Plain nested dicts and lists, as written to a run's config.yaml and a checkpoint."""
    return {name: {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(section).items()}
            for name, section in ((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg))}


def config_from_dict(data: Mapping[str, Any], source: str) -> RunConfig:
    """The inverse of config_to_dict, validated as strictly as a file."""
    return build_config(_flatten(dict(data), source), source)


def dump_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


def _read_yaml(path: Path) -> Any:
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config file ({exc.strerror})") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        problem = getattr(exc, "problem", None) or first_line(exc)
        raise ConfigError(f"{path}: not valid YAML{line}: {problem}") from None


def _flatten(raw: Any, source: str) -> dict[str, tuple[Any, str]]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping of sections ({', '.join(SECTIONS)})")
    out: dict[str, tuple[Any, str]] = {}
    for section, body in raw.items():
        _check_key(str(section), source)
        if section == "task" and isinstance(body, str):  # `task: package.module:function`
            body = {"factory": body}
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(f"{source}: {section}: expected a mapping of keys, got {_describe(body)}")
        for name, value in body.items():
            key = f"{section}.{name}"
            _check_key(key, source)
            out[key] = (value, source)
    return out


def _check_key(key: str, source: str) -> None:
    section, _, name = key.partition(".")
    if section not in SECTIONS:
        raise ConfigError(f"{source}: unknown section '{section}'.{_did_you_mean(section, SECTIONS)} "
                          f"Valid sections: {', '.join(SECTIONS)}")
    if not name and "." in key:
        raise ConfigError(f"{source}: '{key}' names no key; valid keys in {section}: {_names(section)}")
    if name and name not in _field_names(section):
        elsewhere = [other for other in SECTIONS if name in _field_names(other)]
        hint = (f" '{name}' is a key of {' and '.join(elsewhere)}." if elsewhere
                else _did_you_mean(name, _field_names(section), section))
        raise ConfigError(f"{source}: unknown key '{key}'.{hint} Valid keys in {section}: {_names(section)}")
    if not name and source == "--set":
        raise ConfigError(f"--set {key}: name a key, e.g. {section}.{_field_names(section)[0]}")


def _did_you_mean(word: str, choices: Iterable[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" Did you mean '{prefix + '.' if prefix else ''}{close[0]}'?" if close else ""


def _field_names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def _names(section: str) -> str:
    return ", ".join(_field_names(section))


def _field(section: str, name: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)


def _describe(value: Any) -> str:
    kind = {dict: "a mapping", list: "a list", bool: "a boolean", str: "text"}.get(type(value), type(value).__name__)
    return f"{kind} ({value!r})" if not isinstance(value, (dict, list)) else kind


def _convert(raw: Any, hint: Any, spec: dataclasses.Field[Any], where: str, *, from_text: bool) -> Any:
    """Convert one value to the field's type, or raise a ConfigError saying what is allowed."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        if raw is None or (from_text and str(raw).strip().lower() in ("null", "none", "~", "")):
            return None
        (hint,) = [a for a in args if a is not type(None)]
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


def _to_choice(raw: Any, choices: tuple[Any, ...], where: str, from_text: bool) -> Any:
    text = str(raw).strip() if from_text else raw
    if text not in choices:
        raise ConfigError(f"{where}: {raw!r} is not allowed; choose one of {', '.join(map(str, choices))}."
                          + _did_you_mean(str(text), [str(a) for a in choices]))
    return text


def _to_text(raw: Any, spec: dataclasses.Field[Any], where: str) -> str:
    if raw is None and spec.default == "":  # YAML's null for an optional text: its empty default
        return ""
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        return str(raw)
    if not isinstance(raw, str):
        raise ConfigError(f"{where}: expected text, got {_describe(raw)}")
    return raw


def _to_mapping(raw: Any, where: str, from_text: bool) -> dict[str, Any]:
    if from_text and isinstance(raw, str):
        raw = _parse_yaml_text(raw, where)
    if not isinstance(raw, dict) or not all(isinstance(k, str) for k in raw):
        raise ConfigError(f"{where}: expected a mapping of names to values, e.g. {{hidden: 64}}, got "
                          f"{_describe(raw)}")
    return dict(raw)


def _to_list(raw: Any, item: Any, where: str, from_text: bool) -> tuple[Any, ...]:
    """A list of text items, of integers (train.skip_steps) or of mappings (data.mix: its rules)."""
    if from_text:
        raw = _parse_yaml_text(str(raw), where)
    numbers, mappings = item is int, typing.get_origin(item) is dict
    wrong = (lambda v: isinstance(v, bool) or not isinstance(v, int)) if numbers else \
        (lambda v: not isinstance(v, dict)) if mappings else \
        (lambda v: isinstance(v, (dict, list)) or v is None)
    if not isinstance(raw, list) or any(map(wrong, raw)):
        kind = "integers, e.g. [120, 455]" if numbers else "mappings, e.g. [{name: a}]" \
            if mappings else "text items, e.g. ['--exclusive']"
        raise ConfigError(f"{where}: expected a list of {kind}, got {_describe(raw)}")
    return tuple(raw) if numbers or mappings else tuple(str(v) for v in raw)


def _to_bool(raw: Any, where: str, from_text: bool) -> bool:
    if isinstance(raw, bool):
        return raw
    if from_text and str(raw).strip().lower() in _TRUE | _FALSE:
        return str(raw).strip().lower() in _TRUE
    raise ConfigError(f"{where}: expected true or false, got {_describe(raw)}")


def _to_number(raw: Any, kind: type, spec: dataclasses.Field[Any], where: str, from_text: bool) -> Any:
    noun = "an integer" if kind is int else "a number"
    value: Any = raw
    if isinstance(raw, str):  # from --set, or YAML's reading of 3e-4 (without a dot) as text
        try:
            value = kind(raw.strip().replace("_", ""))
        except ValueError:
            raise ConfigError(f"{where}: expected {noun}{_bounds(spec)}, got {_describe(raw)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and isinstance(value, float)):
        raise ConfigError(f"{where}: expected {noun}{_bounds(spec)}, got {_describe(raw)}")
    value = kind(value)
    low, high = spec.metadata.get("min"), spec.metadata.get("max")
    if not math.isfinite(value) or (low is not None and value < low) or (high is not None and value > high):
        raise ConfigError(f"{where}: {value} is out of range; expected {noun}{_bounds(spec)}")
    return value


def _bounds(spec: dataclasses.Field[Any]) -> str:
    low, high = spec.metadata.get("min"), spec.metadata.get("max")
    if low is not None and high is not None:
        return f" between {low} and {high}"
    if low is not None:
        return f" >= {low}"
    return f" <= {high}" if high is not None else ""


def _parse_yaml_text(text: str, where: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        raise ConfigError(f"{where}: {text!r} is not a YAML value (quote text that holds ':' or '#')") from None
