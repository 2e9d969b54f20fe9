"""The task's own figures in `qgtrain eval`: its loss and Task.metrics on its val or test split, for
any task (your own model's, the built-in language model's), on a checkpoint or an export.

They are computed by the loop's own code (training/validation.py's split_figures, evaluation.py),
on the loaders the loop makes (each sample once over all ranks), so they are exact over the whole
split on any number of ranks and named as the loop logs them (`val_loss`, `val_<metric>`,
`test_loss`, `test_<metric>`). The loop's own figures cover its first train.eval_batches batches per
rank (0: the whole split): with the whole split, at the world size it trained on, they are the same
numbers bit for bit. The task is built once (its datasets, loss and metrics; its model left
unbuilt), and each checkpoint's model is scored on it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import RunConfig
from ..config.load import config_from_dict, config_to_dict, with_overrides
from ..data.loaders import EvalShard, make_loader
from ..foundation.errors import ConfigError, QgtrainError
from ..foundation.trust import config_code, require
from ..training.metrics import prefixed
from ..training.parallel.strategy import Strategy
from ..training.validation import split_figures
from .export import rebuild
from .export.bundle import local_files, resolved
from .export.writer import META
from .load_model import read_meta

SPLITS = ("val", "test")


def splits_asked(given: str | None, tasks: bool, yours: bool) -> list[str]:
    """The splits `--split` names (val, test, or both: val,test); without it, val where there are
    no eval.tasks to score on a run or export of yours (anyone else's splits are read only when
    asked), else none. Test is scored only when asked: the loop reports it once, at the end, and
    checkpoints chosen by it would leave no held-out figure."""
    if given is None:
        return ["val"] if not tasks and yours else []
    names = [name.strip() for name in given.split(",") if name.strip()]
    wrong = [name for name in names if name not in SPLITS]
    if wrong or not names:
        raise ConfigError(
            f"eval --split: {given!r} names no split of val and test; give val, test or val,test"
        )
    return [split for split in SPLITS if split in names]


def scored_as(cfg: RunConfig, splits: list[str], tasks: dict[str, str]) -> dict[str, str]:
    """Each split's name and a digest of what its figures depend on beside the checkpoint (the
    task's code and options, the data section, the seed, batch size, weights and precision), before
    `tasks` (eval_results.scored_as's): a line kept from an earlier `qgtrain eval` stands for a
    (step, split) only under the same digest, so a changed task file scores the split again."""
    same = sorted(set(splits) & set(tasks))
    if same:
        raise ConfigError(
            f"eval.tasks: a task is named {same[0]!r}, as the split --split asks for; its lines "
            "would be taken for each other's. HINT: rename the task"
        )
    asked = {
        "code": [_code(named.spec) for named in config_code(cfg)],
        "options": cfg.task.options,
        "data": config_to_dict(cfg)["data"],
        "train": [cfg.train.seed, cfg.train.batch_size, cfg.train.precision, cfg.train.eval_ema],
    }
    text = json.dumps(asked, sort_keys=True, default=str)
    own = {split: hashlib.sha256(f"{split} {text}".encode()).hexdigest()[:16] for split in splits}
    return {**own, **tasks}


def export_config(folder: Path, sets: list[str], trust_code: bool) -> RunConfig:
    """An export's own config (its qgtrain_model.json's), its carried code named where the folder
    is now, `--set` on top: what builds its task's datasets. Its code is imported only with
    --trust-code, whoever owns the folder (trust.py)."""
    saved = config_from_dict(read_meta(folder)["config"], str(folder / META))
    if not trust_code:
        require(
            config_code(saved),
            folder / META,
            what="eval",
            fix="--trust-code",
            why_not="an export folder counts as yours only with --trust-code (a copy or "
            "download of someone's folder is owned by you)",
        )
    return with_overrides(resolved(saved, folder), sets)


class Figures:
    """The splits of a task to score models on, as `holder` holds them, in `precision`."""

    def __init__(
        self,
        cfg: RunConfig,
        splits: list[str],
        holder: Strategy,
        precision: str,
        resumed_from: Path | None,
    ) -> None:
        task = rebuild.rebuild_task(cfg, empty=True, checkpoint=resumed_from)
        for split in splits:
            if getattr(task, split) is None:
                raise QgtrainError(
                    f"eval --split {split}: the task of {cfg.task.factory} has no {split} split "
                    f"(its Task.{split} is None); ask for another with --split"
                )
        self.task, self.holder, self.precision = task, holder, precision
        self.loaders = {  # as data/loaders.py's build_loaders makes the loop's
            split: make_loader(
                getattr(task, split),
                EvalShard(getattr(task, split), holder.env),
                cfg.train.batch_size,
                cfg.data.num_workers,
                holder.device,
                cfg.train.seed,
                False,
                task.collate,
            )
            for split in splits
        }

    def score(self, model: nn.Module, held: nn.Module, split: str) -> dict[str, float | None]:
        """`split`'s figures of `model` (`held`: as the holder wrapped it), named as the loop logs
        them; a collective."""
        figures = split_figures(
            model, held, self.holder, self.task, self.loaders[split], self.precision, self.device
        )
        return prefixed(split, figures)

    @property
    def device(self) -> torch.device:
        return self.holder.device


def _code(spec: str) -> Any:
    """A factory as its figures depend on it: a file's function and the contents of the file and
    the modules of its folder it imports (wherever they are now), or the module's name."""
    file, _, function = spec.rpartition(":")
    if not file.endswith(".py") or not Path(file).is_file():
        return spec
    entry = Path(file).resolve()
    digest = hashlib.sha256(function.encode())
    for path in sorted(local_files(entry)):
        digest.update(str(path.relative_to(entry.parent)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()
