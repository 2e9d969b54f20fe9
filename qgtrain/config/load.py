"""Turning config files and `--set KEY=VALUE` overrides into a validated RunConfig, and back into
YAML.

Later files override earlier ones key by key (config.yaml, then an overlay from jobs/), and `--set`
overrides them all. Every value is converted to its field's type as it is read (config/convert.py),
so a mistake is reported with the file (or `--set`) it came from, the key, what was found and what
is allowed.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

from ..foundation.errors import ConfigError, first_line
from .convert import convert, describe, did_you_mean, parse_yaml_text
from .run import SECTIONS, RunConfig, check_rules

DEFAULT_FILE = Path("config.yaml")


def config_files(given: Iterable[str | Path] | str | Path | None) -> list[Path]:
    """The files to load: those given, else ./config.yaml where there is one (the README's `qgtrain
    train` in the repository), else none (the built-in defaults)."""
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
    parsed = _parse_sets(sets, values)
    values.update(parsed)
    sources += ["--set"] if parsed else []
    return build_config(values, ", ".join(dict.fromkeys(sources)) or "defaults")


def _parse_sets(
    sets: Iterable[str], earlier: Mapping[str, tuple[Any, str]]
) -> dict[str, tuple[Any, str]]:
    """`--set KEY=VALUE` as (text, '--set') per dotted key. `KEY.NAME=VALUE` on a mapping setting
    (task.options, optim.args) sets that one entry, merged into the mapping as `earlier` values
    (the files, or a resolved config) and earlier --set left it; the whole mapping is then checked
    as a file's would be."""
    values: dict[str, tuple[Any, str]] = {}
    for assignment in sets:
        key, sep, text = assignment.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(
                f"--set {assignment!r}: expected KEY=VALUE, e.g. --set train.max_steps=100"
            )
        if key == "task":
            key = "task.factory"
        mapping, _, entry = key.rpartition(".") if _is_mapping_entry(key) else ("", "", "")
        if mapping:
            merged = _mapping_so_far(mapping, {**earlier, **values})
            merged[entry] = parse_yaml_text(text, f"--set {key}")
            values[mapping] = (merged, "--set")
        else:
            _check_key(key, "--set")
            values.update(_anchored({key: (text, "--set")}, Path.cwd()))
    return values


def _is_mapping_entry(key: str) -> bool:
    """Whether `key` is SECTION.NAME.ENTRY with SECTION.NAME a mapping setting."""
    section, _, rest = key.partition(".")
    name, _, entry = rest.partition(".")
    if not entry or "." in entry or section not in SECTIONS or name not in _field_names(section):
        return False
    return typing.get_origin(typing.get_type_hints(SECTIONS[section])[name]) is dict


def _mapping_so_far(key: str, values: Mapping[str, tuple[Any, str]]) -> dict[str, Any]:
    """The mapping a `--set KEY.ENTRY` adds to: an earlier file's or --set's, or the default's."""
    raw, origin = values.get(key, (None, ""))
    if raw is None:
        default = _field(*key.split(".")).default_factory
        raw = default() if callable(default) else {}
    if isinstance(raw, str) and origin == "--set":
        raw = parse_yaml_text(raw, f"--set {key}")
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{origin}: {key}: expected a mapping of names to values, got {describe(raw)}"
        )
    return dict(raw)


def _anchored(values: dict[str, tuple[Any, str]], base: Path) -> dict[str, tuple[Any, str]]:
    """A task, model or data function named as 'file.py:function' with a relative path is relative
    to the config file that names it (to the working directory for --set), and recorded absolute: a
    requeued job, an export or a run started elsewhere finds the same file."""
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
        sections[section][name] = convert(
            raw, hint, spec, f"{origin}: {key}", from_text=origin == "--set"
        )
    cfg = RunConfig(**{name: SECTIONS[name](**kw) for name, kw in sections.items()})
    check_rules(cfg, source)
    return cfg


def with_overrides(cfg: RunConfig, sets: Iterable[str]) -> RunConfig:
    """A resolved config with `--set KEY=VALUE` overrides applied, validated once more as a
    whole."""
    values = _flatten(config_to_dict(cfg), "the given config")
    values.update(_parse_sets(sets, values))
    return build_config(values, "the given config, --set")


def config_to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Plain nested dicts and lists, as written to a run's config.yaml and a checkpoint."""
    return {
        name: {
            k: list(v) if isinstance(v, tuple) else v
            for k, v in dataclasses.asdict(section).items()
        }
        for name, section in ((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg))
    }


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
        raise ConfigError(
            f"{source}: the top level must be a mapping of sections ({', '.join(SECTIONS)})"
        )
    out: dict[str, tuple[Any, str]] = {}
    for section, body in raw.items():
        _check_key(str(section), source)
        if section == "task" and isinstance(body, str):  # `task: package.module:function`
            body = {"factory": body}
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ConfigError(
                f"{source}: {section}: expected a mapping of keys, got {describe(body)}"
            )
        for name, value in body.items():
            key = f"{section}.{name}"
            _check_key(key, source)
            out[key] = (value, source)
    return out


def _check_key(key: str, source: str) -> None:
    section, _, name = key.partition(".")
    if section not in SECTIONS:
        raise ConfigError(
            f"{source}: unknown section '{section}'.{did_you_mean(section, SECTIONS)} "
            f"Valid sections: {', '.join(SECTIONS)}"
        )
    if not name and "." in key:
        raise ConfigError(
            f"{source}: '{key}' names no key; valid keys in {section}: {_names(section)}"
        )
    if name and name not in _field_names(section):
        elsewhere = [other for other in SECTIONS if name in _field_names(other)]
        hint = (
            f" '{name}' is a key of {' and '.join(elsewhere)}."
            if elsewhere
            else did_you_mean(name, _field_names(section), section)
        )
        raise ConfigError(
            f"{source}: unknown key '{key}'.{hint} Valid keys in {section}: {_names(section)}"
        )
    if not name and source == "--set":
        raise ConfigError(f"--set {key}: name a key, e.g. {section}.{_field_names(section)[0]}")


def _field_names(section: str) -> list[str]:
    return [f.name for f in dataclasses.fields(SECTIONS[section])]


def _names(section: str) -> str:
    return ", ".join(_field_names(section))


def _field(section: str, name: str) -> dataclasses.Field[Any]:
    return next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
