"""The export section: the Hugging Face folder a finished run is written to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .fields import setting


@dataclass(frozen=True)
class ExportConfig:
    on_finish: bool = setting(False, "export a Hugging Face model when training finishes (rank 0)")
    dir: str = setting("", "where the export goes ('' = <run dir>/export)")
    dtype: Literal["auto", "bf16", "fp32"] = setting(
        "auto", "the exported weights' dtype (auto: bf16 if the run trained in bf16, else fp32)")
