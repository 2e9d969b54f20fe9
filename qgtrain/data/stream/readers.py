"""The seam between a source of samples and what reads it: a stream of data files (data.stream), a
mixture of sources (data.mix) and a cached source all hand their samples to a loader worker through
this one shape, so a mixture takes any of them and every one resumes exactly.

A reader serves one reading slot (one loader worker of one rank) and knows how far it has read: its
state_dict() after a sample is yielded is the position just past that sample, so a loader worker's
state saved at any step puts the reader back where it was. A pass ends when the iterator stops;
next_pass() starts the following one (a mixture does this when a source runs out, a run when its
epoch ends).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol


class SampleReader(Protocol):
    def __iter__(self) -> Iterator[Any]: ...

    def next_pass(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
