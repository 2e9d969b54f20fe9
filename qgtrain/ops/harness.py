"""`qgtrain eval EXPORT --harness TASK[,TASK]`: lm-evaluation-harness's tasks on an export, offline.

The export is a transformers folder, so the harness's own `hf` model reads it as any user's would;
local task YAMLs come from --include-path (a task over a local jsonl: `dataset_path: json`,
`dataset_kwargs: {data_files: ...}`), and nothing is downloaded: the hub and datasets are told to
stay offline before the harness is imported. Its figures land in the same results file as
qgtrain's own tasks, named eval_<task>_<metric> (its standard errors left out).

An --include-path folder is code, not data: its YAMLs' `!function utils.fn` make lm-eval import the
folder's Python as you. It is read only with --trust-code, and only from a folder that is the
user's alone (foundation/folder_code.py), so a colleague's edit to a shared task folder never runs;
--trust-code is also lm-eval's confirm_run_unsafe_code, and the export's own code (an auto_map)
runs only as folder_code.remote_code allows.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..config import RunConfig
from ..foundation.errors import QgtrainError
from ..foundation.folder_code import remote_code, require_trusted, trusting
from . import eval_out, eval_results
from .export.writer import META

# read by huggingface_hub, datasets and transformers inside the harness: nothing is downloaded
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def evaluate_harness(
    folder: Path,
    tasks: list[str],
    include_path: Path | None,
    cfg: RunConfig,
    out: Path | None = None,
    trust_code: bool = False,
) -> list[dict[str, Any]]:
    """lm-evaluation-harness's `tasks` on an export folder, one process; its lines appended to the
    results beside qgtrain's own (where `qgtrain eval` puts them, eval_out.py). `include_path` is
    code: refused first, unless `trust_code` and the folder is the user's alone."""
    import torch

    require_task_code(include_path, trust_code)
    if not (folder / META).is_file():
        raise QgtrainError(
            f"eval --harness: {folder} is not an export folder (no {META}); export the run first "
            "(qgtrain export RUN --out FOLDER; a LoRA run with --merge)"
        )
    why = eval_out.whose(folder, export=True)
    dest = eval_out.destination(folder, why, out, cfg.logging.runs_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    lines = harness_results(folder, tasks, include_path, cfg.eval.batch_size, device, trust_code)
    lines = [{**line, **({"source": dest.source} if dest.source else {})} for line in lines]
    with eval_results.appending(dest.folder / "results.jsonl") as written:
        written.write("".join(json.dumps(line) + "\n" for line in lines))
    return lines


def require_task_code(include_path: Path | None, trust_code: bool) -> None:
    """Refuse an --include-path unless the user trusts its code and the folder is theirs alone:
    before the harness, the export or any task is read."""
    if include_path is not None:
        with trusting(trust_code, "--trust-code"):
            require_trusted(
                include_path,
                f"--include-path {include_path} holds task YAMLs, whose `!function` tags make "
                "lm-eval import Python from it",
                "eval --harness",
            )


def harness_results(
    folder: Path,
    tasks: list[str],
    include_path: Path | None,
    batch_size: int,
    device: str,
    trust_code: bool = False,
) -> list[dict[str, Any]]:
    """One result line per harness task (and subtask) scored on the export in `folder`; the
    caller has passed `include_path` through require_task_code."""
    with trusting(trust_code, "--trust-code"):
        remote = remote_code(folder, "eval --harness")
    os.environ.update(OFFLINE)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise QgtrainError(
            "eval --harness runs lm-evaluation-harness, which is not installed; install it "
            "with: pip install 'qgtrain[eval]'"
        ) from None
    manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [task for task in tasks if not manager.match_tasks([task])]
    if unknown:
        raise QgtrainError(
            f"eval --harness: no task {', '.join(unknown)} in lm-eval's tasks"
            + (f" or {include_path}" if include_path else "")
            + "; give --include-path FOLDER with the task's YAML"
        )
    out = lm_eval.simple_evaluate(
        model="hf",
        model_args={"pretrained": str(folder), "dtype": "float32", "trust_remote_code": remote},
        tasks=tasks,
        task_manager=manager,
        batch_size=batch_size,
        device=device,
        confirm_run_unsafe_code=trust_code,  # a task marked unsafe_code runs only if trusted
    )
    return [
        {
            "step": None,
            "export": str(folder),
            "task": task,
            "harness": "lm-eval",
            **{
                f"eval_{task}_{key.split(',')[0]}": value
                for key, value in figures.items()
                if isinstance(value, (int, float)) and "stderr" not in key
            },
        }
        for task, figures in out["results"].items()
    ]
