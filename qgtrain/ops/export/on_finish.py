"""export.on_finish: the run's last act, an export of the final checkpoint by `qgtrain export` in a
child process on rank 0 (a fresh one-process group on the CPU, and memory of its own), every rank
returning its outcome. A child, not a call: the export then reads the checkpoint exactly as a later
`qgtrain export` would, and its failure cannot take the finished run with it."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from ...config import RunConfig
from ...foundation.errors import EXIT_FAILED, EXIT_OK
from ...runs.rundir import RunDir
from ...runtime import distributed
from . import target as export_target

logger = logging.getLogger("qgtrain")


EXPORT_TIMEOUT_S = 6 * 3600.0


def export_on_finish(cfg: RunConfig, run_dir: Path) -> int:
    """Rank 0 runs `qgtrain export` in a child process (a fresh one-process group on the CPU, and
    memory of its own); every rank returns its outcome. Training is finished and checkpointed either
    way."""
    out = Path(cfg.export.dir) if cfg.export.dir else RunDir(run_dir).export

    def export() -> tuple[int, str, bool]:
        refused = export_target.refusal(out, force=True)  # never over the user's other files
        if refused is not None:
            return EXIT_FAILED, refused, True
        logger.info("exporting the final checkpoint to %s", out)
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "qgtrain",
                "export",
                str(run_dir),
                "--out",
                str(out),
                "--force",
                "--trust-code",
            ],  # the code this job itself imported
            capture_output=True,
            text=True,
        )
        said = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or [""])[-1]
        return done.returncode, said, False

    returncode, said, refused = distributed.main_works_long(
        export, f"is exporting to {out}", ("its limit", EXPORT_TIMEOUT_S)
    )
    if refused:
        logger.error(
            "training finished, but nothing was exported: %s. HINT: the checkpoints are "
            "intact; export by hand into another folder with "
            "`qgtrain export %s --out OTHER`, or set export.dir to a new or empty folder",
            said,
            run_dir,
        )
        return EXIT_FAILED
    if returncode != 0:
        logger.error(
            "training finished, but the export failed (exit %d): %s. HINT: the checkpoints are "
            "intact; fix the cause and run `qgtrain export %s --out %s`",
            returncode,
            said,
            run_dir,
            out,
        )
        return EXIT_FAILED
    logger.info("%s", said)
    return EXIT_OK
