"""`qgtrain eval EXPORT --harness TASK[,TASK]`: lm-evaluation-harness's tasks on an export, offline.

The export is a transformers folder, so the harness's own `hf` model reads it as any user's would;
local task YAMLs come from --include-path (a task over a local jsonl: `dataset_path: json`,
`dataset_kwargs: {data_files: ...}`), and nothing is downloaded: the hub and datasets are told to
stay offline before the harness is imported. Its figures land in the same results file as
qgtrain's own tasks, named eval_<task>_<metric> (its standard errors left out).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..foundation.errors import QgtrainError

# read by huggingface_hub, datasets and transformers inside the harness: nothing is downloaded
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def harness_results(
    folder: Path, tasks: list[str], include_path: Path | None, batch_size: int, device: str
) -> list[dict[str, Any]]:
    """One result line per harness task (and subtask) scored on the export in `folder`."""
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
        model_args=f"pretrained={folder},dtype=float32",
        tasks=tasks,
        task_manager=manager,
        batch_size=batch_size,
        device=device,
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
