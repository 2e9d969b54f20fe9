"""Submit training from Python with submitit, and wait for it with a deadline.

    python jobs/submitit_job.py [--config config.yaml] [--set train.max_steps=2000 ...] [--timeout-h
    48] python jobs/submitit_job.py --dry-run # print the Slurm parameters, submit nothing

The job requeues itself on Slurm's warning signal and resumes from its checkpoint; the result is the
run directory and exit code of the final allocation.
"""

from __future__ import annotations

import argparse
import json
import sys

import qgtrain
from qgtrain.foundation.errors import QgtrainError


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="config.yaml")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--timeout-h", type=float, default=48.0, help="stop waiting after this many hours"
    )
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    overrides = dict(item.split("=", 1) for item in args.set)
    if args.dry_run:
        from qgtrain.config.load import load_config
        from qgtrain.launch.submitit_params import executor_parameters

        print(json.dumps(executor_parameters(load_config([args.config], args.set)), indent=1))
        return
    try:
        job = qgtrain.submit(
            args.config, **{key.replace(".", "__"): value for key, value in overrides.items()}
        )
    except QgtrainError as exc:  # one line, as the CLI says it (no Slurm here, a bad value)
        print(f"qgtrain: error: {exc}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    print(f"submitted job {job.job_id}; submitit logs in {job.paths.folder}")
    print(job.result(timeout=args.timeout_h * 3600))


if __name__ == "__main__":
    main()
