"""Wall time of the commands a login node answers (`qgtrain --help`, `qgtrain submit --dry-run`),
each as a fresh process, alternated with the floor (an interpreter that does nothing) and with
`import torch`, which these paths must never pay. Usage: python -m bench.cli_startup [--repeats 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import alternate

ROOT = Path(__file__).resolve().parents[1]


def command(*args: str) -> object:
    return lambda: subprocess.run(
        [sys.executable, *args], cwd=ROOT, check=True, stdout=subprocess.DEVNULL
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    times = alternate(
        {
            "qgtrain --help": command("-m", "qgtrain", "--help"),
            "qgtrain submit --dry-run": command("-m", "qgtrain", "submit", "--dry-run"),
            "python -c pass": command("-c", "pass"),
            "python -c 'import torch'": command("-c", "import torch"),
        },
        args.repeats,
    )
    for name, values in times.items():
        median = statistics.median(values)
        goal = " (goal < 0.3 s)" if name.startswith("qgtrain") else ""
        print(f"{name}: median {median:.3f} s{goal}")


if __name__ == "__main__":
    main()
