"""Task functions that raise as a user's own code does, named in configs as
'tests.raising_tasks:<function>': the failure is theirs, and qgtrain must say so in one line."""

from __future__ import annotations

import json

import qgtrain
from tests.tasks import points


def build(cfg: qgtrain.RunConfig) -> qgtrain.Task:
    """Reads a data file of its own first, as many tasks do; task.options.data names one that may
    not be there."""
    with open(str(cfg.task.options.get("data", "missing.jsonl"))) as samples:
        json.load(samples)
    return points(cfg)
