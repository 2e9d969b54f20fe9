"""Background threads a fork must not cut in half.

A forked child holds a copy of every lock as it was at the fork, and none of the threads that held
them: a lock taken by another thread at that instant (a C++ mutex inside torch or gloo, a buffered
stream's) stays taken in the child for good, and the child hangs the first time it asks for it.
DataLoader workers are forked (the default on Linux) at the first batch of a loader and, for a
stream, at each epoch, while an asynchronous checkpoint may be writing, rotating and logging in the
background. So each such thread is registered here, and a fork of this process first waits for
the registered threads to finish: a stream's new epoch may wait for a save's last seconds, never
for a hang. subprocess starts programs without these hooks (it execs at once), and so does not
wait.
"""

from __future__ import annotations

import os
import threading
import weakref

_UNFINISHED: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_hooked = False


def finished_before_fork(thread: threading.Thread) -> threading.Thread:
    """Register `thread` (started or about to be) so that a fork waits for it; returns it.

    The wait is hooked in at the first thread, not at import: Python runs before-fork hooks the
    last registered first, so it then comes before those of the libraries already loaded, whose
    hooks take locks a save's thread may need (concurrent.futures' takes the shutdown lock that the
    writer pool's submit takes too): waiting after them would never end."""
    global _hooked
    if not _hooked:
        os.register_at_fork(before=_wait_for_registered)
        _hooked = True
    _UNFINISHED.add(thread)
    return thread


def _wait_for_registered() -> None:
    for thread in list(_UNFINISHED):
        if thread is not threading.current_thread() and thread.ident is not None:
            thread.join()
