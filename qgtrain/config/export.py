"""The export section: the Hugging Face folder a finished run is written to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .fields import Problem, setting

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass(frozen=True)
class ExportConfig:
    on_finish: bool = setting(False, "export a Hugging Face model when training finishes (rank 0)")
    dir: str = setting("", "where the export goes ('' = <run dir>/export)")
    dtype: Literal["auto", "bf16", "fp32"] = setting(
        "auto", "the exported weights' dtype (auto: bf16 if the run trained in bf16, else fp32)"
    )
    merge: bool = setting(
        False,
        "LoRA runs: export.on_finish and `qgtrain export` write the merged model instead "
        "of a PEFT adapter folder",
    )


def export_rules(cfg: RunConfig) -> Problem:
    """An export on finish that could only fail is refused before training, not after it."""
    if (
        cfg.export.on_finish
        and cfg.model.adapter == "lora"
        and not cfg.model.pretrained
        and not cfg.export.merge
    ):
        return "export.merge", (
            "false with export.on_finish, model.adapter lora and no model.pretrained: an "
            "adapter folder must name a base its user can load, and this base is drawn from "
            "train.seed; set export.merge: true (the merged model), or export.on_finish: false"
        )
    return None
