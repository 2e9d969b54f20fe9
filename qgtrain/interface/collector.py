"""CPython's cyclic garbage collector in a `qgtrain` process: fewer collections while it starts,
none of the whole heap while it exits.

A rank is a short-lived process with a large heap: importing torch and transformers creates some
370,000 tracked objects, none of them garbage, and with the default thresholds (700, 10, 10) the
collector walks that growing heap again and again while they load (perf puts `gc_collect_main` at a
fifth of an import's samples); at exit, the interpreter's final collections walk all of it once
more. Every rank of every start, export and evaluation pays it: `bench.process_cost` times whole
processes (a few steps of `qgtrain train` on one CPU rank, `qgtrain export`).

- At start, the youngest generation is collected every 7,000 allocations instead of 700: the
  import storm triggers a tenth as many collections. Cycles made while training are still
  collected, a tenth as often.
- At exit (atexit, once the command has returned and closed what it opened), every object moves to
  the permanent generation (`gc.freeze`), which the interpreter's final collections skip: the
  process is ending, and its memory goes back to the system whole. What must be written is closed
  before: the run's files by their owners, logging's handlers by logging's own atexit (registered
  earlier, so run later), stdout and stderr by the interpreter, which flushes them last.
"""

from __future__ import annotations

import atexit
import gc

YOUNGEST_THRESHOLD = 7_000


def quiet_for_a_command() -> None:
    youngest, middle, oldest = gc.get_threshold()
    if youngest:  # 0: the collector is off, as its user set it
        gc.set_threshold(max(YOUNGEST_THRESHOLD, youngest), middle, oldest)
    atexit.register(gc.freeze)
