"""A folder held by what it is, not by its name: what makes the checks of a run folder count.

The checks of a run folder (rundir.require_safe) are made on a path, and the work is done later on
whatever the path names: in a runs folder others can write, a colleague can rename the run folder
seconds after the start and move a prepared one in, whose inductor cache would then be loaded and
into which the checkpoints would be written. So the folder checked is pinned by its device and
inode, and each use that matters (a checkpoint's commit, the compile cache's claim, a job's
snapshot) first checks that the path still names it (`check`); the run stops, writing nothing,
when it does not. No torch here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .errors import QgtrainError


class FolderReplaced(QgtrainError):
    """A run folder's path names another folder than the one checked at start."""


@dataclass(frozen=True)
class Pinned:
    path: Path
    device: int
    inode: int

    @classmethod
    def now(cls, path: Path) -> Pinned:
        """The folder `path` names now (a link of the user's is followed, as the checks follow
        it); OSError where there is none."""
        info = os.stat(path)
        return cls(Path(path), info.st_dev, info.st_ino)

    def replaced(self) -> str | None:
        """The line that stops the run when `path` no longer names the pinned folder; None while
        it does."""
        try:
            info = os.stat(self.path)
            if (info.st_dev, info.st_ino) == (self.device, self.inode):
                return None
        except OSError:
            pass
        return (
            f"{self.path} is no longer the folder checked at start (it was replaced): stopping "
            f"without writing. HINT: someone who can write {self.path.parent} renamed it; keep "
            "runs in a folder only you can write"
        )

    def check(self) -> None:
        if line := self.replaced():
            raise FolderReplaced(line)
