"""The shape of the package, enforced: imports point down the layers, modules stay readable in one
sitting, login-node paths never import torch, and only rendezvous.py reads launcher variables. Runs
against: the source files (ast), and a fresh interpreter for the import check."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "qgtrain"
# Folders are layers; a module imports only from its own layer or below. The foundation everything
# reads (errors, the Task contract, trust, files) and the config are the bottom; the interface the
# top.
LAYERS: dict[int, set[str]] = {
    0: {"foundation", "config"},
    # the process: rendezvous, its group and device, signals, logs, diagnosis
    1: {"runtime"},
    # samples and loaders; checkpoints; the run directory that holds them
    2: {"data", "state", "runs"},
    3: {"tasks"},  # the built-in tasks and models
    4: {"training", "evals"},  # the loop, evaluation, optimizer, schedule; downstream tasks
    5: {"ops"},  # export, runs, plot, doctor
    6: {"run"},  # the composition root: builds the parts and trains
    7: {"launch"},  # sbatch and submitit
    8: {"interface", "__main__", "__init__"},  # __init__: the public facade, loading lazily
}
PLACE = {name: layer for layer, names in LAYERS.items() for name in names}
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)
NO_TORCH = [
    "qgtrain",
    "qgtrain.interface.cli",
    "qgtrain.interface.commands",
    "qgtrain.config",
    "qgtrain.runtime.rendezvous",
    "qgtrain.runtime.devices",
    "qgtrain.runtime.comms",
    "qgtrain.ops.collective",
    "qgtrain.launch.sbatch",
    "qgtrain.ops.runs",
    "qgtrain.runs.rundir",
    "qgtrain.state.layout",
    "qgtrain.runtime.slurm_values",
    "qgtrain.state.checkpoint",
    "qgtrain.training.metrics",
    "qgtrain.data.files.sources",
    "qgtrain.ops.data_info",
    "qgtrain.launch.sweep",
    "qgtrain.runtime.slurm",
    "qgtrain.runs.lifecycle",
    "qgtrain.launch.slurm_checks",
    "qgtrain.launch.submitit_params",
    *(
        f"qgtrain.{folder}.{p.stem}"
        for folder in ("config", "foundation")
        for p in (PACKAGE / folder).glob("*.py")
        if p.stem != "__init__"
    ),
]


def dotted(path: Path) -> str:
    """qgtrain/state/checkpoint.py -> state.checkpoint; qgtrain/state/__init__.py -> state."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(name: str) -> int:
    head = name.split(".")[0] if name else "__init__"
    return PLACE[head] if head in PLACE else PLACE[name]


def internal_imports(path: Path, for_types: bool = True) -> set[str]:
    """Every qgtrain module this file imports, in any form, as dotted names under qgtrain. `from .
    import x` imports the package and then x; `from .pkg import name` imports pkg, and pkg.name if
    that is a module. `for_types=False` leaves out what only `if TYPE_CHECKING:` imports."""
    own = dotted(path)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    typing_only = {
        id(inner)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for inner in ast.walk(node)
    }
    found = set()
    for node in ast.walk(tree):
        if not for_types and id(node) in typing_only:
            continue
        bases: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.level:
            parts = package.split(".") if package else []
            parts = parts[: len(parts) - (node.level - 1)]
            bases = [".".join([*parts, *([node.module] if node.module else [])]).strip(".")]
        elif (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "qgtrain"
        ):
            bases = [node.module.partition(".")[2]]
        elif isinstance(node, ast.Import):
            bases = [
                a.name.partition(".")[2] for a in node.names if a.name.split(".")[0] == "qgtrain"
            ]
        for base in bases:
            found.add(base)
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    candidate = f"{base}.{alias.name}".strip(".")
                    if (PACKAGE / f"{candidate.replace('.', '/')}.py").exists():
                        found.add(candidate)
    return found


def test_every_module_is_placed_in_a_layer():
    for path in MODULES:
        layer_of(dotted(path))


def test_the_import_reader_sees_every_form():
    assert internal_imports(PACKAGE / "run.py") >= {
        "state",
        "state.checkpoint",
        "runtime.distributed",
        "training.trainer",
    }
    commands = PACKAGE / "interface" / "commands.py"
    assert "ops.export.pipeline" in internal_imports(commands), "an import inside a function counts"
    assert internal_imports(PACKAGE / "state" / "checkpointer.py") >= {"state", "state.checkpoint"}


def test_imports_point_down_the_layers():
    upward = {
        f"{dotted(path)} (layer {layer_of(dotted(path))})": sorted(
            m for m in internal_imports(path) if layer_of(m) > layer_of(dotted(path))
        )
        for path in MODULES
    }
    assert not {name: found for name, found in upward.items() if found}, (
        "modules that import from above"
    )


# Modules that pass 300 lines because they are one concern, each with its reason: split along a
# concern, never to fit the count.
ONE_CONCERN = {
    "ops.doctor": "every check of `qgtrain doctor`, node-local then across nodes, one checklist",
    "training.trainer": "the whole loop, a step's end included, read top to bottom in one place",
    "runs.rundir": "a run directory's layout, creation and who may write it: one map, one place",
    "interface.cli": "the whole command line, one parser read top to bottom",
    "launch.stages": "a chain of jobs: planned, written, handed on and described in one place",
    "state.checkpointer": "a save and a restore, every rank on one collective path, end to end",
}


def test_modules_stay_readable_in_one_sitting():
    """At most 300 lines a module (or a reason in ONE_CONCERN) and 60 a function: a module is one
    concern, a function one thing."""
    long_modules = {
        dotted(p): n
        for p in MODULES
        if (n := len(p.read_text().splitlines())) > 300 and dotted(p) not in ONE_CONCERN
    }
    long_functions = {
        f"{dotted(p)}.{node.name}": node.end_lineno - node.lineno + 1
        for p in MODULES
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > 60
    }
    assert not long_modules and not long_functions, (long_modules, long_functions)


def test_no_module_imports_itself_through_others():
    """No import cycles, imports inside functions counted: a cycle hidden behind an import in a
    function is still two modules that cannot be read, or moved, one without the other. Packages'
    __init__ (the facades) and imports for type checking only are left out."""
    modules = {dotted(p): p for p in MODULES if p.name != "__init__.py"}
    graph = {
        name: {m for m in internal_imports(path, for_types=False) if m in modules and m != name}
        for name, path in modules.items()
    }
    cycles = set()
    for start in graph:
        trail, seen = [(start, (start,))], set()
        while trail:
            here, path = trail.pop()
            for nxt in graph[here]:
                if nxt == start:
                    cycles.add(tuple(sorted(path)))
                elif nxt not in seen:
                    seen.add(nxt)
                    trail.append((nxt, (*path, nxt)))
    assert not cycles, sorted(cycles)


def test_each_class_name_names_one_class():
    """One word per concept: a class name defined in two modules makes a reader ask which."""
    where: dict[str, list[str]] = {}
    for path in MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: places for name, places in where.items() if len(places) > 1} == {}


def test_the_code_passes_the_linter():
    """ruff with the settings in pyproject.toml: import order, line length, unused names,
    complexity."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        cwd=PACKAGE.parent,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-4000:]


def test_login_node_paths_import_neither_torch_nor_transformers():
    code = (
        f"import importlib, sys\nfor m in {NO_TORCH!r}: importlib.import_module(m)\nprint(sorted(m "
        "for m in ('torch', 'transformers', 'submitit', 'numpy') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def test_only_rendezvous_reads_the_environment_and_edges_pass_it_in():
    """Launch and device decisions are functions of a mapping the edges pass in. The one other
    reader is the trackers' setup, which honours the tracker libraries' own variables (as the
    libraries would) by a default argument that tests replace."""
    for path in MODULES:
        text = path.read_text()
        if path.stem == "rendezvous":
            assert "import os" not in text, (
                "rendezvous takes a mapping; the caller passes os.environ"
            )
            continue
        for line in text.splitlines():
            if "os.environ" in line or "getenv(" in line:
                # comms.apply writes what NCCL and gloo read (they read nothing else); it reads
                # nothing
                assert (
                    path.stem in ("commands", "api", "submitit_launcher")
                    and "from_environ(os.environ)" in line
                    or "checks = run_checks(cfg, env, os.environ" in line
                    or path.stem == "trackers"
                    and "environ: Mapping[str, str] = os.environ" in line
                    or (path.stem == "comms" and line.strip() == "os.environ.update(settings)")
                    # the harness keeps the libraries it runs offline; it reads nothing
                    or (path.stem == "harness" and line.strip() == "os.environ.update(OFFLINE)")
                ), f"{path.name}: {line.strip()}"


# torch's names for a layout's wrappers and tensors: what only the strategies, and the checkpoint's
# sharded state that reads and writes their tensors, may know.
LAYOUT_NAMES = {
    "DistributedDataParallel",
    "DDP",
    "FSDPModule",
    "fully_shard",
    "MixedPrecisionPolicy",
    "DTensor",
    "distribute_tensor",
}
LAYOUT_MODULES = ("torch.nn.parallel", "torch.distributed.fsdp", "torch.distributed.tensor")
KNOWS_LAYOUTS = ("training/parallel/", "state/sharded.py")


def layout_names(tree: ast.AST) -> set[str]:
    """The layout names a module's code uses (its docstrings and comments may say them)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in LAYOUT_NAMES:
            found.add(node.id)
        elif isinstance(node, ast.Attribute) and node.attr in LAYOUT_NAMES:
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(LAYOUT_MODULES):
            found.add(str(node.module))
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(LAYOUT_MODULES)}
    return found


def test_only_the_strategies_and_the_sharded_state_name_ddp_fsdp_and_dtensor():
    """A new layout (tensor parallelism, say) is a class in training/parallel/ and a mesh: no other
    room asks which wrapper or tensor type it holds."""
    assert layout_names(ast.parse("from torch.distributed.fsdp import fully_shard\nx.DTensor"))
    outside = {
        str(path.relative_to(PACKAGE)): sorted(names)
        for path in MODULES
        if not str(path.relative_to(PACKAGE)).startswith(KNOWS_LAYOUTS)
        and (names := layout_names(ast.parse(path.read_text())))
    }
    assert outside == {}


def test_what_the_seeds_got_wrong_stays_out():
    text = "\n".join(p.read_text() for p in MODULES)
    assert "empty_cache" not in text and "CUDA_LAUNCH_BLOCKING" not in text
    from qgtrain.config import TrainConfig

    assert TrainConfig().find_unused_parameters is False, (
        "DDP looks for unused parameters only on request"
    )
    broad = [line for line in text.splitlines() if "except Exception" in line]
    assert all("raises bare Exceptions" in line for line in broad), broad


def test_the_package_type_checks_strictly():
    """mypy with the settings in pyproject.toml (strict, less what untyped libraries make
    impractical)."""
    result = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=PACKAGE.parent, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout[-4000:]


def _docstring_lines(tree: ast.Module, lines: list[str]) -> Iterator[list[tuple[int, str]]]:
    """Each docstring of a module as its numbered source lines."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                if isinstance(first.value.value, str) and first.end_lineno:
                    span = range(first.lineno, first.end_lineno + 1)
                    yield [(n, lines[n - 1]) for n in span]


def _orphaned_tail(before: str, line: str) -> bool:
    """A paragraph's last line of a word or two that fits on the line before it."""
    text = line.strip()
    indent = len(line) - len(line.lstrip())
    return (
        bool(before.strip())
        and not before.rstrip().endswith('"""')
        and indent == len(before) - len(before.lstrip())
        and not text.startswith(('"""', "|", "-", "*", ">>>"))
        and 1 <= len(text.replace('"""', "").split()) <= 2
        and len(before.rstrip()) + 1 + len(text) <= 100
    )


def test_docstrings_keep_their_layout():
    """What a reformat must not do to a docstring, checked line by line (text compared with its
    whitespace collapsed cannot see layout): a table keeps one width, row by row, and no paragraph
    ends in a word or two that fit on the line before (a wrapped line's orphaned tail)."""
    problems = []
    for path in MODULES:
        lines = path.read_text().splitlines()
        for doc in _docstring_lines(ast.parse("\n".join(lines)), lines):
            rows = [(n, line.count("|")) for n, line in doc if line.strip().startswith("|")]
            for (n, cells), (previous, width) in zip(rows[1:], rows):
                if n == previous + 1 and cells != width:
                    problems.append(f"{dotted(path)}:{n}: a table row of another width")
            for (_, before), (n, line) in zip(doc, doc[1:]):
                ends = line.rstrip().endswith('"""') or n == len(lines) or not lines[n].strip()
                if ends and _orphaned_tail(before, line):
                    problems.append(f"{dotted(path)}:{n}: {line.strip()!r} fits on the line before")
    assert not problems, problems
