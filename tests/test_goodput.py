"""Where a run's time went (training/goodput.py), across a start that was killed and the one that
resumed it. Runs against: real `qgtrain train` processes (a task whose steps are a sleep, so their
time is known), a SIGKILL, the run's status.json and metrics.jsonl."""

from __future__ import annotations

import json
import time

from tests.helpers import ROOT, cli, kill_once_saved, overlay, records, sleep_paced
from tests.ranks import start_cli_ranks, wait_ranks


def test_a_killed_and_resumed_run_accounts_for_all_its_time_and_its_recomputed_steps(tmp_path):
    """Killed after step 30, its last checkpoint at step 20: the next start trains 21-30 again
    (recomputed, each a 0.05 s sleep) and the rest for the first time. The kinds add up to the
    run's time: from the first process's start to the last write, the second's wait included."""
    reports = tmp_path / "reports.yaml"
    reports.write_text(
        "train: {log_every: 5}\ntask: {options: {size: 4096, step_s: 0.05, eval_batch_s: 0.01}}\n"
    )
    configs = [
        ROOT / "config.yaml",
        ROOT / "jobs" / "cpu.yaml",
        overlay(tmp_path, 80, 20),
        sleep_paced(tmp_path),
        reports,
    ]
    args = ["train", *[a for c in configs for a in ("--config", str(c))]]
    run = tmp_path / "runs" / "cpu"
    began = time.time()
    procs = start_cli_ranks(1, args, tmp_path)
    kill_once_saved(run, procs, 30)
    wait_ranks(procs, 60)
    first = json.loads((run / "status.json").read_text())["time"]
    time.sleep(1.0)  # the wait a retry's back-off would be
    done = cli(*args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    ended = time.time()

    kept = json.loads((run / "status.json").read_text())["time"]
    seconds = kept["seconds"]
    assert (kept["starts"], kept["reached"]) == (2, 80)
    assert first["starts"] == 1 and first["reached"] >= 30
    # 21 to the highest step the first start reported, each a 0.05 s sleep, trained again;
    # evaluation: the final validation and test, each batch a 0.01 s sleep
    assert seconds["recomputed"] >= 0.05 * (first["reached"] - 20)
    assert seconds["training"] >= 0.05 * 80
    assert seconds["waiting"] >= 1.0, "the kill's lost tail and the pause before the restart"
    for kind in ("checkpoint", "evaluation", "startup", "other"):
        assert seconds[kind] > 0, kind
    # both ledgers count from the first process's start: the second added exactly the time since
    total = sum(seconds.values())
    first_start = first["written"] - sum(first["seconds"].values())
    assert began <= first_start and abs(kept["written"] - total - first_start) < 0.05
    assert kept["written"] <= ended
    assert abs(kept["goodput"] - seconds["training"] / total) < 1e-3
    reported = [r for r in records(run) if "goodput" in r]
    assert reported and all(0 < r["goodput"] < 1 for r in reported)
    # each kind's share beside it, adding up to the whole
    kinds = ["goodput", *(f"time_{kind}" for kind in seconds if kind != "training")]
    last = reported[-1]
    assert abs(sum(last[kind] for kind in kinds) - 1) < 1e-6, last
    assert last["time_recomputed"] > 0
    shown = cli("runs", str(run), cwd=tmp_path).stdout
    assert (
        f"cpu: time {total:.1f} s in 2 starts: training {seconds['training'] / total:.0%}" in shown
    )
    assert f"recomputed {seconds['recomputed'] / total:.0%}" in shown, shown


def test_the_goodput_model_saves_at_the_interval_that_wastes_least():
    """bench/goodput.py's Young/Daly interval: any other interval wastes more."""
    from bench.goodput import best_interval, wasted

    save_s, restart_s, mtbf_s = 0.907, 11.0, 3.1 * 3600
    best = best_interval(save_s, mtbf_s)
    least = wasted(best, save_s, restart_s, mtbf_s)
    assert all(wasted(best * f, save_s, restart_s, mtbf_s) > least for f in (0.5, 0.9, 1.1, 2))
