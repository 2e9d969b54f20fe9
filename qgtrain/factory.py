"""User extension points: a model or dataset factory named as 'package.module:function' in the config."""

from __future__ import annotations

import importlib
from typing import Any

from .errors import ConfigError


def load_factory(spec: str, key: str) -> Any:
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{key}: cannot load {spec!r} ({exc}). HINT: the module must be importable "
                          "from where qgtrain runs (installed, or on PYTHONPATH)") from None
