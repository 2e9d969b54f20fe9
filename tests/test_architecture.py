"""The shape of the package, enforced: imports point down the layers, modules stay readable in one
sitting, login-node paths never import torch, and only rendezvous.py reads launcher variables. Runs
against: the source files (ast), and a fresh interpreter for the import check."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "qgtrain"
LAYERS = {
    0: {"errors", "config", "configload", "rendezvous", "schedule", "rundir", "sbatch", "signals",
        "factory", "tokenizer", "corpus", "metrics", "checkpoint", "runs", "log"},
    1: {"cpu", "distributed", "precision", "rng", "data", "models", "optim", "checkpointer", "diagnose", "train_state"},
    2: {"trainer"},
    3: {"run", "export", "doctor", "plot", "submitit_launcher"},
    4: {"cli", "__main__", "__init__"},  # __init__: the public facade, whose qgtrain.submit loads lazily
}
LAYER_OF = {module: layer for layer, modules in LAYERS.items() for module in modules}
NO_TORCH = ["qgtrain", "qgtrain.cli", "qgtrain.config", "qgtrain.configload", "qgtrain.rendezvous",
            "qgtrain.sbatch", "qgtrain.runs", "qgtrain.rundir", "qgtrain.checkpoint", "qgtrain.metrics"]
MODULES = sorted(p for p in PACKAGE.glob("*.py"))


def internal_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found |= {node.module.split(".")[0]} if node.module else {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("qgtrain."):
            found.add(node.module.split(".")[1])
    return found


def test_every_module_is_placed_in_a_layer():
    assert {p.stem for p in MODULES} == set(LAYER_OF)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_imports_point_down_the_layers(path):
    layer = LAYER_OF[path.stem]
    upward = {m for m in internal_imports(path) if LAYER_OF.get(m, -1) > layer}
    assert not upward, f"{path.name} (layer {layer}) imports {upward} from above"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: p.name)
def test_modules_stay_under_300_lines(path):
    assert len(path.read_text().splitlines()) <= 300


def test_login_node_paths_import_neither_torch_nor_transformers():
    code = (f"import importlib, sys\nfor m in {NO_TORCH!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in ('torch', 'transformers', 'submitit', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_only_rendezvous_reads_the_environment_and_edges_pass_it_in():
    for path in MODULES:
        text = path.read_text()
        if path.stem == "rendezvous":
            assert "import os" not in text, "rendezvous takes a mapping; the caller passes os.environ"
            continue
        for line in text.splitlines():
            if "os.environ" in line or "getenv(" in line:
                assert path.stem in ("cli", "submitit_launcher") and "from_environ(os.environ)" in line or \
                    "checks = run_checks(cfg, env, os.environ)" in line, f"{path.name}: {line.strip()}"


def test_what_the_seeds_got_wrong_stays_out():
    text = "\n".join(p.read_text() for p in MODULES)
    assert "empty_cache" not in text and "CUDA_LAUNCH_BLOCKING" not in text
    assert "find_unused_parameters: bool = setting(False" in (PACKAGE / "config.py").read_text()
    broad = [line for line in text.splitlines() if "except Exception" in line]
    assert all("raises bare Exceptions" in line for line in broad), broad
