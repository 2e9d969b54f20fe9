"""bench/gpu_check's own logic, on the CPU: what a GPU machine's run would be judged by. The full
CPU dry run (`python -m bench.gpu_check`, exit 2) takes minutes; these take seconds."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.gpu_check import memory, procs, runs
from bench.gpu_check.checks import judge_probe, judge_speed
from bench.gpu_check.report import Report


def test_a_hanging_run_is_a_failure_with_its_log_not_a_crash(tmp_path: Path) -> None:
    log = tmp_path / "hang.log"
    began = time.monotonic()
    done = procs.run(
        [sys.executable, "-c", "print('got this far', flush=True); import time; time.sleep(600)"],
        log,
        timeout=2,
    )
    assert done.code is None and not done.ok and time.monotonic() - began < 40
    assert "timed out after 2 s" in done.describe() and "got this far" in done.describe()
    report = Report("cpu", "x")
    judge_speed(report, done, "", 64)
    assert report.results[-1].verdict == "FAIL" and "got this far" in report.results[-1].detail


def test_the_hanging_runs_children_are_killed_with_it(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    child = (
        f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; "
        f"time.sleep(600)']); open({str(pid_file)!r}, 'w').write(str(p.pid)); time.sleep(600)"
    )
    done = procs.run([sys.executable, "-c", child], tmp_path / "log", timeout=3)
    assert done.code is None
    pid = int(pid_file.read_text())
    for _ in range(100):
        if subprocess.run(
            ["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True
        ).stdout.strip() in ("", "Z"):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"child {pid} outlived the timeout")


def test_summary_table_is_markdown_with_one_row_per_check() -> None:
    report = Report("1 x NVIDIA H100 80GB HBM3", "2.13.0")
    report.check(True, "speed", "ratio 0.991")
    report.check(False, "memory | fsdp", "1.2 GB", "too much\nheld")
    report.skip("hsdp", "needs 2 GPUs")
    rows = report.table().splitlines()
    assert rows[0] == "| check | result | figure | device | torch |" and len(rows) == 5
    assert all(row.count(" | ") == 4 for row in [rows[0], *rows[2:]])
    assert rows[3] == "| memory \\| fsdp | FAIL | 1.2 GB | 1 x NVIDIA H100 80GB HBM3 | 2.13.0 |"
    assert "| hsdp | SKIP | needs 2 GPUs |" in rows[4]
    assert report.summary() == "1 passed, 1 failed, 1 skipped; failed: memory | fsdp"


def test_expected_memory_shares() -> None:
    ddp = memory.ddp(1_000_000, slack_bytes=0)
    assert ddp.holds(16e6) and not ddp.holds(14e6) and not ddp.holds(20e6)
    fsdp = memory.fsdp(
        1_000_000, 4, largest_unit=100_000, gathered_bytes_per_param=2, slack_bytes=0
    )
    assert fsdp.holds(4e6) and fsdp.holds(4.5e6) and not fsdp.holds(16e6)  # unsharded state fails
    assert not fsdp.holds(3e6)
    with pytest.raises(ValueError):
        memory.fsdp(1, 0, 1, 2)


def test_resume_is_held_to_equality_only_where_two_runs_agree() -> None:
    report = Report("cpu", "x")
    runs.judge_resume(
        report, "r", *runs.spread_and_worst({1: 1.0, 2: 0.5}, {1: 1.0, 2: 0.5}, {1: 1.0, 2: 0.5})
    )
    runs.judge_resume(report, "r", *runs.spread_and_worst({1: 1.0}, {1: 1.0}, {1: 1.0 + 1e-7}))
    runs.judge_resume(report, "r", *runs.spread_and_worst({1: 1.0}, {1: 1.001}, {1: 1.0015}))
    runs.judge_resume(
        report, "r", *runs.spread_and_worst({1: 1.0}, {1: 1.0}, {})
    )  # the resumed run lost steps
    assert [r.verdict for r in report.results] == ["PASS", "FAIL", "PASS", "FAIL"]


def test_checkpoint_stall_from_step_times() -> None:
    times, t = [], 0.0
    for step in range(1, 31):
        times.append({"step": step, "loss": 1.0, "time": t})
        t += 0.1 + (0.5 if step % 10 == 0 else 0.0)
    stall, typical = runs.checkpoint_stall(times, 10, 30) or (0, 0)
    assert stall == pytest.approx(0.5) and typical == pytest.approx(0.1)
    assert runs.checkpoint_stall(times[:5], 10, 30) is None


def test_probe_checks_fail_on_wrong_facts() -> None:
    layout = {"losses": [1.0], "want_losses": [1.0], "grad_diff": 0.0, "param_diff": 0.0}
    good = {
        "collective": {"all_reduce": [1.0] * 4, "backend": "gloo"},
        "agreement": {"stop_read_at": [[4, 3]]},
        "ddp": dict(layout),
        "fsdp": dict(layout),
    }
    report = Report("cpu", "x")
    judge_probe(report, [good], "cpu")
    assert [r.verdict for r in report.results] == ["PASS"] * 4
    bad = {
        **good,
        "collective": {"all_reduce": [2.0] * 4, "backend": "gloo"},
        "agreement": {"stop_read_at": [[3, 2]]},
        "fsdp": {**layout, "grad_diff": 0.5},
    }
    report = Report("cpu", "x")
    judge_probe(report, [bad], "cpu")
    assert [r.verdict for r in report.results] == ["FAIL", "FAIL", "PASS", "FAIL"]


def speed_result(ratio: float, mfu: float, start_s: float, data_wait: float, *warned: str) -> str:
    """bench.train_speed's last line, as it prints it (compiled, as on a GPU, where warnings are
    given)."""
    sides = ("qgtrain", "hand-written")
    got = {
        "compiled": bool(warned) or None,
        "compile_warnings": [w for w in warned if w],
        "ratio": ratio,
        "tokens_per_s": dict(zip(sides, (ratio * 1000.0, 1000.0))),
        "mfu": dict(zip(sides, (mfu, mfu / ratio))),
        "first_step_s": dict(zip(sides, (5.0 + start_s, 5.0))),
        "data_wait": data_wait,
    }
    return "steps/s: ...\nresult " + json.dumps(got) + "\n"


@pytest.mark.parametrize(
    ("batch", "reading", "verdicts"),
    [
        (64, (0.99, 0.41, 0.5, 0.005), ["PASS"] * 4),
        (64, (0.97, 0.41, 0.5, 0.005), ["FAIL", "PASS", "PASS", "PASS"]),
        (64, (0.99, 0.35, 0.5, 0.005), ["PASS", "FAIL", "PASS", "PASS"]),
        (64, (0.99, 0.41, 1.5, 0.005), ["PASS", "PASS", "FAIL", "PASS"]),
        (64, (0.99, 0.41, 0.5, 0.012), ["PASS", "PASS", "PASS", "FAIL"]),
        (16, (0.99, 0.15, 0.5, 0.005), ["PASS"] * 3),  # MFU is held to its goal at batch 64 only
        (16, (0.99, 0.15, 0.5, 0.005, ""), ["PASS"] * 4),  # compiled, no warning
        (
            16,
            (0.99, 0.15, 0.5, 0.005, "model.compile: dynamo compiled nothing"),
            ["PASS"] * 3 + ["FAIL"],
        ),
    ],
)
def test_speed_readings_are_held_to_issue_47s_goals(batch, reading, verdicts) -> None:
    report = Report("cuda", "x")
    judge_speed(report, procs.Finished(0, 1.0, Path("log")), speed_result(*reading), batch)
    assert [r.verdict for r in report.results] == verdicts, report.results
    assert all(r.name.startswith(f"gpt2-124m batch {batch}: ") for r in report.results)


def tiny_speed_reading(tmp_path: Path, *args: str) -> tuple[procs.Finished, str]:
    """bench.train_speed of the tiny preset on one CPU rank, one round; and what it printed."""
    done = procs.run(
        [sys.executable, "-m", "bench.train_speed", "--preset", "tiny", "--world", "1"]
        + ["--rounds", "1", *args],
        tmp_path / "speed.log",
        timeout=300,
    )
    return done, (tmp_path / "speed.log").read_text()


def test_train_speeds_own_output_is_what_the_check_reads(tmp_path: Path) -> None:
    done, output = tiny_speed_reading(tmp_path, "--steps", "30", "--batch", "2")
    report = Report("cpu", "x")
    judge_speed(report, done, output, 16)
    names = [r.name.removeprefix("gpt2-124m batch 16: ") for r in report.results]
    assert names == [
        "tokens/s, qgtrain / hand-written compiled alike",
        "process start to first step",
        "waiting for data",
    ], report.results
    assert re.fullmatch(r"ratio \d+\.\d{3}", report.results[0].figure), report.results[0]


def test_a_failed_qgtrain_run_ends_the_speed_reading_with_its_own_error(tmp_path: Path) -> None:
    done, output = tiny_speed_reading(tmp_path, "--steps", "20", "--set", "bogus.key=1")
    assert not done.ok and "metrics.jsonl" not in output, output[-2000:]
    assert "-m qgtrain train exited 2" in output and "unknown section 'bogus'" in output, output


def test_the_runs_keep_the_callers_python_path_behind_this_tree(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONPATH", "/opt/wheels:/opt/more")
    assert procs.search_path() == f"{procs.ROOT}:/opt/wheels:/opt/more"
    monkeypatch.delenv("PYTHONPATH")
    assert procs.search_path() == str(procs.ROOT)
