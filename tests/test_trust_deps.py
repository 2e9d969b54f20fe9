"""The dependency floors: what setup.sh does with a system torch that predates them.

A site's `module load` torch is used as it is (QGTRAIN_TORCH=system), so pyproject's floor never
reaches it: setup.sh itself must refuse one whose weights_only loader has a known memory corruption,
since "checkpoints are data" rests on that loader. The old torch here is a package that only says
its version: setup.sh reads nothing else of it before it refuses.
"""

from __future__ import annotations

import os
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.ranks import ROOT


def _system_torch(
    tmp_path: Path, torch_version: str, **env: str
) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "__init__.py").write_text(f"__version__ = {torch_version!r}\n")
    return subprocess.run(
        ["bash", str(ROOT / "setup.sh")],
        capture_output=True,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "PYTHONPATH": str(site),
            "QGTRAIN_TORCH": "system",
            "QGTRAIN_VENV": str(tmp_path / "venv"),
            **env,
        },
    )


@pytest.mark.parametrize("old", ["2.9.1+cu126", "2.6.0"])
def test_a_system_torch_older_than_the_floor_is_refused_naming_the_advisory(
    tmp_path: Path, old: str
) -> None:
    done = _system_torch(tmp_path, old)
    assert done.returncode == 2, done.stderr
    said = done.stderr.strip().splitlines()
    assert len(said) == 1, said
    assert f"torch {old} is older than 2.10" in said[0]
    assert "CVE-2026-24747" in said[0] and "QGTRAIN_ALLOW_OLD_TORCH=1" in said[0]
    assert not list((tmp_path / "venv").glob("lib/python*/site-packages/qgtrain*"))


def test_the_installed_packages_meet_the_floors_the_advisories_ask() -> None:
    """The environment the suite runs in is one a user gets from setup.sh: a floor lowered or
    dropped from pyproject.toml while a patched version happens to be installed fails here."""
    text = (ROOT / "pyproject.toml").read_text()
    for floor in ('"torch>=2.10"', '"transformers>=5.5"', '"peft>=0.20"', '"jinja2>=3.1.6"'):
        assert floor in text, floor
    for package, least in [("torch", (2, 10)), ("transformers", (5, 5)), ("peft", (0, 20))]:
        found = tuple(int(part) for part in version(package).split("+")[0].split(".")[:2])
        assert found >= least, (package, found)
