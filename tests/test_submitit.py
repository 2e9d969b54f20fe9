"""What qgtrain takes from submitit beyond its public API, checked against the installed submitit: a
new release that renames one of those members fails here, not in a requeue on a cluster. Runs
against: the installed submitit package (its classes and their source)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from submitit.core.job_environment import JobEnvironment

from qgtrain.launch import submitit_compat


def test_every_private_member_qgtrain_uses_is_in_the_installed_submitit():
    assert submitit_compat.missing_members() == []


def test_a_member_that_is_gone_is_reported(monkeypatch):
    monkeypatch.setitem(
        submitit_compat.PRIVATE_MEMBERS, JobEnvironment, ("_usr_sig", "_gone_in_a_release")
    )
    assert submitit_compat.missing_members() == ["JobEnvironment._gone_in_a_release"]


@pytest.mark.parametrize("exported, expected", [("USR1", signal.SIGUSR1), (None, signal.SIGUSR2)])
def test_the_preemption_signal_is_the_one_the_job_handler_listens_for(exported, expected):
    """The job script exports SUBMITIT_PREEMPT_SIGNAL before Python starts (executor_parameters)."""
    code = (
        "from qgtrain.launch.submitit_compat import preemption_signal; print(preemption_signal())"
    )
    env = {k: v for k, v in os.environ.items() if k != "SUBMITIT_PREEMPT_SIGNAL"}
    shown = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, **({"SUBMITIT_PREEMPT_SIGNAL": exported} if exported else {})},
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert int(shown) == expected
