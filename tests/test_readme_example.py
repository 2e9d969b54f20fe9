"""README's own-model example, as a user copies it: the `# my_task.py` block saved in a folder of
their own and the command below it run there as written (the venv's qgtrain, nothing of this
repository on the path), then run again, which must find the run finished."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ranks import ROOT

README = ROOT / "README.md"


def own_model_example() -> tuple[str, list[str]]:
    """The task file's text and the command's arguments after `qgtrain`."""
    text = README.read_text()
    task = re.search(r"```python\n(# my_task\.py\n.*?)```", text, re.S)
    command = re.search(r"```bash\n(qgtrain train --set task=my_task\.py:build[^\n]*)\n```", text)
    assert task and command, "README.md's own-model example moved: update this test"
    return task.group(1), shlex.split(command.group(1))[1:]


def qgtrain(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(
        [sys.executable, "-m", "qgtrain", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_the_own_model_example_trains_as_written_and_a_second_start_finds_it_finished(tmp_path):
    task, args = own_model_example()
    (tmp_path / "my_task.py").write_text(task)
    done = qgtrain(args, tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    written = (run / "metrics.jsonl").read_text()
    logged = [json.loads(line) for line in written.splitlines()]
    final = [r for r in logged if "test_accuracy" in r][-1]
    assert final["test_accuracy"] > 0.9 and final["val_accuracy"] > 0.9, final
    again = qgtrain(args, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "this run already ended at step" in again.stderr + again.stdout
    assert (run / "metrics.jsonl").read_text() == written, "a finished run took more steps"
