"""Steps trained again after a SIGKILL at a random step: the node-local tier saving every
--local-every steps beside the shared tier, against the shared tier alone (every --every steps).

Two gloo ranks stand for two nodes (each its own local folder, each keeping the other's replica)
and run `qgtrain train` on the main job (config.yaml) or, with --big, a 302.6M GPT-2 (24 x 1024)
under fsdp, saving asynchronously. A trial draws a step uniformly from [--first, --last], waits
until rank 0 has logged it (every step is logged), SIGKILLs both ranks with their workers, starts
them again and reads which checkpoint the new start resumed from: the steps recomputed are the last
step logged before the kill minus that one. The cadence alone predicts (k - 1) / 2 on average for a
save every k steps; more means saves that were not yet on disk when the kill came.

Usage: python -m bench.recomputed [--big] [--trials 4] [--every 50] [--local-every 2]
[--first 50 --last 100] [--seed 0] [--local-only]
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import tempfile
from pathlib import Path

from tests.helpers import logged_step, rank_log, wait_for
from tests.ranks import kill_ranks, start_cli_ranks

BIG = [
    "model.layers=24",
    "model.hidden=1024",
    "model.heads=16",
    "data.name=synthetic",
    "data.seq_len=16",
    "data.synthetic_samples=4096",
    "train.batch_size=1",
    "train.parallel=fsdp",
]


STEP = re.compile(r"INFO step \d+/")
RESUMED = re.compile(r"resumed from \S+/step-(\d+): step \d+, epoch \d+( \(node-local tier)?")


def arguments(run: Path, every: int, local_every: int, big: bool) -> list[str]:
    sets = [
        "train.log_every=1",
        "train.eval_every=0",
        "train.max_steps=5000",
        "logging.tensorboard=false",
        "checkpoint.async_save=true",
        f"checkpoint.every_steps={every}",
        *(BIG if big else []),
    ]
    if local_every:
        sets += [
            f"checkpoint.local_dir={run.parent}/node$GROUP_RANK",
            f"checkpoint.local_every_steps={local_every}",
        ]
    return ["train", "--set", *sets, "--run-dir", str(run)]


def on_two_nodes(rank: int) -> dict[str, str]:
    return {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": str(rank)}


def trial(folder: Path, args: list[str], kill_at: int) -> tuple[int, int, str]:
    """The last step logged before the kill, the step the next start resumed from (0: none it
    could), and the tier that held it."""
    run = folder / "run"
    procs = start_cli_ranks(2, args, folder, env=on_two_nodes)
    wait_for(lambda: logged_step(run) >= kill_at, procs, f"step {kill_at}", 1800, 0.05)
    kill_ranks(procs)
    killed, before = logged_step(run), len(rank_log(run, 0))
    procs = start_cli_ranks(2, args, folder, env=on_two_nodes, log_prefix="again")
    wait_for(
        lambda: STEP.search(rank_log(run, 0)[before:]), procs, "the next start's step", 600, 0.05
    )
    kill_ranks(procs)
    found = RESUMED.search(rank_log(run, 0)[before:])
    if found is None:
        return killed, 0, "no checkpoint"
    return killed, int(found.group(1)), "node-local tier" if found.group(2) else "shared tier"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--big", action="store_true")
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--local-every", type=int, default=2)
    parser.add_argument("--first", type=int, default=50)
    parser.add_argument("--last", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local-only", action="store_true", help="skip the shared tier alone")
    args = parser.parse_args()
    chance = random.Random(args.seed)
    model = "302.6M GPT-2 under fsdp" if args.big else "the main job's model under ddp"
    print(f"{model}, 2 gloo ranks, async saves; kill steps from [{args.first}, {args.last}]")
    for local_every in (args.local_every,) if args.local_only else (0, args.local_every):
        cadence = (
            f"every_steps {args.every}, local_every_steps {local_every}"
            if local_every
            else f"every_steps {args.every} alone"
        )
        lost = []
        for _ in range(args.trials):
            at = chance.randint(args.first, args.last)
            with tempfile.TemporaryDirectory(prefix="recomputed-") as name:
                folder = Path(name)
                settings = arguments(folder / "run", args.every, local_every, args.big)
                killed, resumed, tier = trial(folder, settings, at)
            lost.append(killed - resumed)
            print(f"  {cadence}: killed after step {killed}, resumed from {resumed} ({tier})")
        print(
            f"{cadence}: steps recomputed, mean {statistics.mean(lost):.1f}, median "
            f"{statistics.median(lost)}, most {max(lost)} (cadence alone: "
            f"{((local_every or args.every) - 1) / 2:.1f} on average)"
        )


if __name__ == "__main__":
    main()
