"""What `qgtrain.train` returns: the documented exit code as an int, so that a script's
`sys.exit(qgtrain.train(...))` still exits with it, carrying where the run is and what it last
reported, so that a script can go on to evaluate or export without reading the run's files."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


class TrainResult(int):
    """The exit code (0; 75 or 76 after a stop at a checkpoint), with `run_dir` (the run directory),
    `step` (the last step logged) and `metrics` (the latest value of every figure logged: loss,
    val_*, test_*, ...). Read on rank 0; the other ranks get the code, the directory, no step and
    no metrics (only rank 0 writes metrics.jsonl). Read-only, like the int it is."""

    run_dir: Path
    step: int | None
    metrics: dict[str, float]

    def __new__(
        cls,
        code: int,
        run_dir: Path,
        step: int | None = None,
        metrics: Mapping[str, float] | None = None,
    ) -> TrainResult:
        result = super().__new__(cls, code)
        object.__setattr__(result, "run_dir", Path(run_dir))
        object.__setattr__(result, "step", step)
        object.__setattr__(result, "metrics", dict(metrics or {}))
        return result

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a TrainResult cannot be changed ({name})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a TrainResult cannot be changed ({name})")

    def __reduce__(self) -> tuple[Any, ...]:
        return TrainResult, (int(self), self.run_dir, self.step, self.metrics)

    def __repr__(self) -> str:
        return (
            f"TrainResult({int(self)}, run_dir={str(self.run_dir)!r}, step={self.step}, "
            f"metrics={self.metrics!r})"
        )

    __str__ = int.__repr__  # printed, formatted or logged, it is the exit code
