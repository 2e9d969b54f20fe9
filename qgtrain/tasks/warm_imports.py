"""transformers imported in a background thread while `qgtrain train` forms its process group and
claims its run directory, so the task's model build does not wait for it.

transformers imports lazily: `import transformers` and the architecture's modeling module cost
about 3 s of the task phase on the CPU, most of it before the first weight is drawn (issue 47). The
thread imports them while the main thread mostly waits on sockets and files (the rendezvous, the
run directory's barriers), then the task build joins it (`wait`, tasks/build.py) before anything
else of transformers is touched, so no module is ever imported by two threads at once from two
sides. Only the built-in language model is warmed (a task's own model may never import
transformers); a failure here is left for the main thread's own import to report.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

from ..config import RunConfig
from ..foundation.task import BUILTIN_LM

_started: list[threading.Thread] = []


def start(cfg: RunConfig) -> None:
    """Begin importing what building cfg's model needs, if it is the built-in language model's."""
    if cfg.task.factory != BUILTIN_LM or cfg.model.factory or _started:
        return
    arch = _pretrained_arch(Path(cfg.model.pretrained)) if cfg.model.pretrained else cfg.model.arch
    thread = threading.Thread(target=_import, args=(arch,), name="qgtrain-imports", daemon=True)
    thread.start()
    _started.append(thread)


def wait() -> None:
    """Join the imports begun by `start`, if any."""
    while _started:
        _started.pop().join()


def _import(arch: str | None) -> None:
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        if arch:  # the lookup imports the architecture's modeling module
            MODEL_FOR_CAUSAL_LM_MAPPING[transformers.AutoConfig.for_model(arch).__class__]
    except Exception:  # huggingface_hub's config validation raises bare Exceptions
        return  # the build's own import says what is wrong, in its own words


def _pretrained_arch(folder: Path) -> str | None:
    try:
        arch = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return arch if isinstance(arch, str) else None
