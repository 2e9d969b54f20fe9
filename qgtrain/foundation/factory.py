"""User extension points: a function named in the config, as 'package.module:function' (importable
from where qgtrain runs) or as 'path/to/file.py:function' (a file of your own, relative to the
working directory; nothing needs installing).

A file imports the modules of its own folder as it would when run as a script (`python file.py`
puts its folder first on sys.path), wherever qgtrain runs: its folder leads sys.path while the file
runs, so its own `helpers.py` is the one imported, then stays at the end, where an import inside
one of its functions still finds it without shadowing anything installed. So a task file and its
helpers work from any working directory, and from the copy an export carries (export/bundle.py).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from .errors import ConfigError


def load_factory(spec: str, key: str) -> Any:
    module_name, _, attr = spec.rpartition(":")
    try:
        module = (
            _load_file(Path(module_name))
            if module_name.endswith(".py")
            else importlib.import_module(module_name)
        )
        return getattr(module, attr)
    except (ImportError, AttributeError, FileNotFoundError) as exc:
        raise ConfigError(
            f"{key}: cannot load {spec!r} ({exc}). HINT: the module must be importable "
            "from where qgtrain runs (installed, or on PYTHONPATH), or name a file as "
            "path/to/file.py:function"
        ) from None


def _load_file(path: Path) -> Any:
    """Import a .py file once, under a name of its own, so pickling its classes (DataLoader workers
    started by spawn, submitit) finds them again."""
    path = path.resolve()
    name = f"qgtrain_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    if not path.is_file():
        raise FileNotFoundError(f"no file {path}")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = str(path.parent)
    sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(folder)
        if folder not in sys.path:
            sys.path.append(folder)
    return module
