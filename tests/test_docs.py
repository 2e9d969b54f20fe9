"""The documentation: the site (mkdocs.yml, docs/) builds strictly and reads with no network, its
generated pages equal what docs/generate.py writes, README.md stays short and its links to docs/
resolve, and every code block a reader may copy works here or says what it needs.

A code block says what it is (```yaml, ```bash, ```text, ...) and is checked by that: a yaml block
loads as a qgtrain config overlay, a python block runs (pasted into a file of a folder holding
config.yaml), and in a bash, sh or console block each `qgtrain` command parses with the CLI's own
parser (nothing is run); other languages are not checked. A python block whose example needs a run,
an export or a base model says on the line above which test runs it with the page's text
(`<!-- runs in: tests/test_export.py -->`), and that test must. A block whose line directly above is
`<!-- needs: slurm -->` (or gpu, or network; several separated by commas) is only checked to be
well-formed (its yaml parses, its python compiles, its qgtrain commands parse), and only such a
block may call Slurm's commands (slurm) or nvidia-smi (gpu).

Runs against: mkdocs in a subprocess (the venv's, from the dev extra), the config loader and the
CLI's argparse parser in this process."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from qgtrain.config import SECTIONS
from qgtrain.config.load import load_config
from qgtrain.foundation.errors import ConfigError
from qgtrain.interface.cli import _parser
from tests.doc_blocks import (
    DOCS,
    FENCE,
    GENERATED,
    NEEDS_MARK,
    README,
    ROOT,
    RUNS_MARK,
    Block,
    code_blocks,
    pages,
    run_by,
)

README_MAX_LINES = 250

NEEDS = ("slurm", "gpu", "network")
SLURM_COMMANDS = {"sbatch", "srun", "squeue", "scontrol", "sacct", "salloc", "scancel", "sinfo"}
GPU_COMMANDS = {"nvidia-smi"}
SHELLS = {"bash", "sh", "console"}
# what a shell line writes before a command's name: variables, and the words of loops and ifs
PREFIX_WORDS = {"do", "then", "else", "elif", "time", "exec", "nohup", "env", "!", "{"}
ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=.*")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(?P<word>[A-Za-z_]\w*)\1")
REDIRECT = re.compile(r"(?<!\S)\d*(?:&>>?|>>?&?|<<?-?|<&)\s*(?:'[^']*'|\"[^\"]*\"|[^\s;&|<>]+)")
# a value the reader fills in: <run dir> (not a redirection), and a word holding $VAR or ${VAR}
ANGLED = re.compile(r"<[A-Za-z](?:[\w .:/-]*[\w.])?>")
PLACEHOLDER = re.compile(r"\$\{?\w+\}?")
STANDS_IN = "1"


BLOCKS = [block for page in pages() for block in code_blocks(page)]


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where() for block in BLOCKS])
def test_a_code_block_runs_here_or_says_what_it_needs(
    block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not block.closed:
        pytest.fail(f"{block.where()}: the code block is never closed")
    if not block.language:
        pytest.fail(
            f"{block.where()}: a code block without a language; say what it is (```bash, "
            "```yaml, ```python, ```text for output, ...)"
        )
    if unknown := sorted(block.needs - set(NEEDS)):
        pytest.fail(
            f"{block.where()}: <!-- needs: ... --> names {', '.join(unknown)}; it may name "
            f"{', '.join(NEEDS)}"
        )
    if block.language == "yaml":
        _check_yaml(block, tmp_path)
    elif block.language == "python":
        _check_python(block, tmp_path, monkeypatch)
    elif block.language in SHELLS and (problems := _shell_problems(block)):
        pytest.fail("\n".join(problems))


def _check_python(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A python block compiles; one that needs nothing this machine lacks then runs as pasted
    into a file of a folder holding config.yaml (this process: torch and qgtrain are imported
    already), or in the test its mark names, which must run it by the page's own text."""
    try:
        code = compile(block.text, block.where(), "exec")
    except SyntaxError as exc:
        pytest.fail(
            f"{block.where((exc.lineno or 1) - 1)}: the python block does not compile: {exc.msg}"
        )
    if block.needs:
        return
    if block.runs_in:
        test = ROOT / block.runs_in
        runs = (
            [snippet for page, snippet in run_by(test) if page == block.page]
            if test.is_file()
            else []
        )
        assert any(snippet in block.text for snippet in runs), (
            f"{block.where()}: <!-- runs in: {block.runs_in} --> but that file runs no python "
            f"block of {block.page} holding this one's text (python_block({block.page!r}, ...))"
        )
        return
    (tmp_path / "config.yaml").write_bytes((ROOT / "config.yaml").read_bytes())
    monkeypatch.chdir(tmp_path)
    exec(code, {"__name__": "__main__", "__file__": str(tmp_path / "pasted.py")})


def _check_yaml(block: Block, tmp_path: Path) -> None:
    """An unmarked yaml block is a config overlay that loads; a marked one only parses."""
    if block.needs:
        try:
            yaml.safe_load(block.text)
        except yaml.YAMLError as exc:
            pytest.fail(f"{block.where()}: the yaml block does not parse: {exc}")
        return
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(block.text)
    try:
        load_config([overlay])
    except ConfigError as exc:
        pytest.fail(
            f"{block.where()}: the yaml block is not a qgtrain config that loads: {exc}. A block "
            "that is no qgtrain config takes another language (```text); one that needs what "
            "this machine lacks says so: <!-- needs: network --> on the line above"
        )


def _shell_problems(block: Block) -> list[str]:
    problems = []
    for offset, line in shell_lines(block):
        where = block.where(offset)
        try:
            commands = simple_commands(line)
        except ValueError as exc:
            problems.append(f"{where}: not a shell command ({exc}): {line}")
            continue
        for words in commands:
            name = Path(words[0]).name
            for need, names in (("slurm", SLURM_COMMANDS), ("gpu", GPU_COMMANDS)):
                if name in names and need not in block.needs:
                    problems.append(
                        f"{where}: {name} needs {need}: put <!-- needs: {need} --> on the line "
                        "directly above the block"
                    )
            argv = qgtrain_argv(words)
            if argv is not None and "$(" not in line and "`" not in line:
                refused = parse_problem(argv)
                if refused:
                    problems.append(f"{where}: `{' '.join(words)}` does not parse: {refused}")
    return problems


def shell_lines(block: Block) -> list[tuple[int, str]]:
    """The command lines of a shell block, as (offset in the block, the line with its
    continuations joined and its comment cut): a console block's are those after a `$ ` prompt
    where it has any; a here-document's body is no command."""
    lines = block.text.splitlines()
    prompted = block.language == "console" and any(line.startswith("$ ") for line in lines)
    found: list[tuple[int, str]] = []
    index, heredoc = 0, ""
    while index < len(lines):
        start, line = index, lines[index]
        index += 1
        if heredoc:
            heredoc = "" if line.strip() == heredoc else heredoc
            continue
        if prompted and not line.startswith("$ "):
            continue
        line = line.removeprefix("$ ")
        while line.endswith("\\") and index < len(lines):
            following = lines[index].removeprefix("> ") if prompted else lines[index]
            line = line[:-1] + " " + following.strip()
            index += 1
        line = _without_comment(line).strip()
        if line:
            opened = HEREDOC.search(line)
            heredoc = opened["word"] if opened else ""
            found.append((start, line))
    return found


def _without_comment(line: str) -> str:
    """A shell line up to its comment: a # that starts a word, outside quotes."""
    quote, escaped = "", False
    for at, char in enumerate(line):
        if escaped:
            escaped = False
        elif char == "\\" and quote != "'":
            escaped = True
        elif quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (at == 0 or line[at - 1].isspace()):
            return line[:at]
    return line


def simple_commands(line: str) -> list[list[str]]:
    """The words of each command of a line split on && || ; | & ( ), redirections left out, each
    without the variables and shell words before its name; raises ValueError where quotes do not
    close."""
    line = REDIRECT.sub(" ", ANGLED.sub("$PLACEHOLDER", line))
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = ""
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set("();&|<>"):
            commands.append([])
        else:
            commands[-1].append(token)
    found = []
    for words in commands:
        while words and (ASSIGNMENT.fullmatch(words[0]) or words[0] in PREFIX_WORDS):
            words = words[1:]
        if words:
            found.append(words)
    return found


def qgtrain_argv(words: list[str]) -> list[str] | None:
    """The arguments of a `qgtrain` (.venv/bin/qgtrain, python -m qgtrain) command, else None."""
    if Path(words[0]).name == "qgtrain":
        return words[1:]
    if re.fullmatch(r"python[0-9.]*", Path(words[0]).name) and words[1:3] == ["-m", "qgtrain"]:
        return words[3:]
    return None


def parse_problem(argv: list[str]) -> str:
    """What the CLI's parser says of `qgtrain ARGV`, or '' where it takes them (--help too). A
    word the reader fills in ($RUN, <run dir>) stands in as '1', and a refusal of that value is
    none: the reader's value decides."""
    argv = [STANDS_IN if PLACEHOLDER.search(word) else word for word in argv]
    said = io.StringIO()
    try:
        with redirect_stdout(io.StringIO()), redirect_stderr(said):
            _parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code not in (0, None):
            message = (said.getvalue().strip().splitlines() or [f"exit code {exc.code}"])[-1]
            return "" if f"'{STANDS_IN}'" in message else message
    return ""


def _block(text: str, language: str = "bash", needs: str = "") -> Block:
    return Block("page.md", 1, language, text, frozenset(needs.split()), True)


@pytest.mark.parametrize(
    "text, needs, expected",
    [
        ("qgtrain train --set train.max_steps=10 optim.lr=3e-4\n", "", ""),
        ("qgtrain train --bogus\n", "", "unrecognized arguments: --bogus"),
        ("qgtrain export runs/x\n", "", "required: --out"),
        ("qgtrain export runs/$RUN --step ${STEP} --out <folder>\n", "", ""),
        ("qgtrain export runs/x --out y --dtype $DTYPE\n", "", ""),
        ("qgtrain export runs/x --out y --dtype fp8\n", "", "invalid choice: 'fp8'"),
        ("$ .venv/bin/qgtrain --help\n", "", ""),
        ("python -m qgtrain data prepare --workers 4\n", "", ""),
        ("python -m qgtrain data prepare --workers four\n", "", "invalid int value"),
        ("qgtrain train \\\n  --set train.max_steps=10 \\\n  --wrong\n", "", "--wrong"),
        ("FOO=1 qgtrain train 2>&1 | tee log.txt && echo done\n", "", ""),
        ("qgtrain submit --set slurm.container_image=nvcr.io#nvidia/pytorch:24.08-py3\n", "", ""),
        ("for lr in 1e-3 3e-4; do qgtrain train --set optim.lr=$lr; done\n", "", ""),
        ("qgtrain eval <run dir> --step <N> --out runs/<name>/eval\n", "", ""),
        ("qgtrain runs  # --not-an-option\n", "", ""),
        ("sbatch train.slurm\n", "", "sbatch needs slurm"),
        ("sbatch train.slurm\nsqueue --me\n", "slurm", ""),
        ("qgtrain train; squeue --me\n", "", "squeue needs slurm"),
        ("srun nvidia-smi\n", "slurm", ""),
        ("nvidia-smi -L\n", "", "nvidia-smi needs gpu"),
        ("# sbatch in a comment\n", "", ""),
        ("cat > job.sh <<'EOF'\nsbatch inside a here-document\nEOF\nqgtrain runs\n", "", ""),
        ("echo 'unclosed\n", "", "not a shell command"),
        ("srun qgtrain train --nope\n", "slurm", ""),
    ],
)
def test_the_shell_checks_catch_what_they_are_for(text: str, needs: str, expected: str) -> None:
    said = "\n".join(_shell_problems(_block(text, needs=needs)))
    assert (expected in said) if expected else not said, said


def test_a_console_block_runs_only_its_prompted_lines() -> None:
    block = _block("$ qgtrain runs\nsbatch: not a command, output\n$ qgtrain nope\n", "console")
    assert _shell_problems(block) == [
        "page.md:4: `qgtrain nope` does not parse: " + parse_problem(["nope"])
    ]


def test_blocks_are_found_with_their_language_line_and_needs(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        'text\n\n<!-- needs: slurm, gpu -->\n```bash title="x"\nsrun nvidia-smi\n```\n\n'
        "1. a step\n\n    ```yaml\n    train:\n      max_steps: 5\n    ```\n\n"
        "````markdown\n```python\nx\n```\n````\n\n```\nbare\n```\n\n~~~py\nopen\n"
    )
    found = [(b.line, b.language, b.text, sorted(b.needs), b.closed) for b in code_blocks(page)]
    assert found == [
        (4, "bash", "srun nvidia-smi\n", ["gpu", "slurm"], True),
        (10, "yaml", "train:\n  max_steps: 5\n", [], True),
        (15, "markdown", "```python\nx\n```\n", [], True),
        (21, "", "bare\n", [], True),
        (25, "python", "open\n", [], False),
    ]


@pytest.mark.parametrize("page", pages(), ids=[str(p.relative_to(ROOT)) for p in pages()])
def test_a_mark_sits_directly_above_a_code_block(page: Path) -> None:
    lines = page.read_text().splitlines()
    stray = [
        f"{page.relative_to(ROOT)}:{number}"
        for number, line in enumerate(lines, 1)
        if (NEEDS_MARK.fullmatch(line) or RUNS_MARK.fullmatch(line))
        and (number == len(lines) or not FENCE.match(lines[number]))
    ]
    assert not stray, (
        f"<!-- needs: ... --> and <!-- runs in: ... --> mark the code block whose opening fence "
        f"is on the very next line (no blank line between); these mark none: {', '.join(stray)}"
    )


def test_the_site_builds_strictly_and_loads_nothing_from_the_network(tmp_path: Path) -> None:
    """mkdocs --strict fails on a page missing from nav, a broken link or anchor (mkdocs.yml's
    validation); the site reads offline: no web fonts, no script or stylesheet from a CDN, and
    mermaid is the vendored copy, which defines window.mermaid so Material loads none."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.is_file():
        pytest.fail(
            f"{mkdocs} is missing: mkdocs-material is in the dev extra; run ./setup.sh --dev"
        )
    site = tmp_path / "site"
    built = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr[-6000:]
    remote = []
    for path in sorted(site.rglob("*")):
        if path.suffix not in (".html", ".css"):
            continue
        text = path.read_text(errors="replace")
        remote += [f"{path.relative_to(site)}: {hit}" for hit in _remote_loads(text)]
    assert not remote, "\n".join(remote[:20])
    mermaid = site / "assets" / "javascripts" / "mermaid.min.js"
    assert mermaid.is_file() and 'globalThis["mermaid"]' in mermaid.read_text(), (
        "docs/assets/javascripts/mermaid.min.js is not mermaid's dist/mermaid.min.js"
    )
    assert 'src="assets/javascripts/mermaid.min.js"' in (site / "index.html").read_text()


def _remote_loads(text: str) -> list[str]:
    """What a page or stylesheet would fetch from elsewhere: scripts, stylesheets, fonts."""
    hits = re.findall(r"<script\b[^>]*\bsrc=[\"']?(?:https?:)?//[^\"'\s>]+", text, re.I)
    for tag in re.findall(r"<link\b[^>]*>", text, re.I):
        rel = re.search(r"\brel=[\"']?([^\"'>]+)", tag)
        href = re.search(r"\bhref=[\"']?((?:https?:)?//[^\"'\s>]+)", tag)
        fetched = {"stylesheet", "preload", "modulepreload", "preconnect", "icon"}
        if href and rel and fetched & set(rel.group(1).lower().split()):
            hits.append(tag)
    hits += re.findall(r"@import\s+(?:url\()?[\"']?(?:https?:)?//[^\s;)]+", text)
    hits += re.findall(r"fonts\.(?:googleapis|gstatic)\.com", text)
    return hits


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_generate", DOCS / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", GENERATED)
def test_the_generated_pages_are_what_the_code_says(name: str) -> None:
    generator = _generator()
    expected = {"configuration.md": generator.configuration_page, "cli.md": generator.cli_page}
    written = (DOCS / name).read_text() if (DOCS / name).is_file() else ""
    wanted = expected[name]()
    if written != wanted:
        diff = difflib.unified_diff(
            written.splitlines(), wanted.splitlines(), f"docs/{name}", "generated", lineterm=""
        )
        version = " (argparse lays out help by the Python it runs on)" if name == "cli.md" else ""
        pytest.fail(
            f"docs/{name} is not what the code says: run `.venv/bin/python docs/generate.py`"
            f"{version}\n" + "\n".join(list(diff)[:40])
        )


def test_the_configuration_page_has_every_key_and_the_cli_page_every_command() -> None:
    configuration = (DOCS / "configuration.md").read_text()
    keys = [
        f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)
    ]
    missing = [key for key in keys if f"{{#{key}}}" not in configuration]
    missing += [f"## {section}" for section in SECTIONS if f"\n## {section}\n" not in configuration]
    assert not missing, f"docs/configuration.md lacks {missing}"
    cli = (DOCS / "cli.md").read_text()
    commands = [" ".join(("qgtrain", *words)) for words in _subcommands(_parser())]
    assert len(commands) > 10
    assert not [c for c in commands if f"\n## {c} {{#" not in cli], "docs/cli.md lacks a command"


def _subcommands(
    parser: argparse.ArgumentParser, words: tuple[str, ...] = ()
) -> list[tuple[str, ...]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += [(*words, name), *_subcommands(sub, (*words, name))]
    return found


def test_the_readme_is_short_and_its_links_into_docs_resolve() -> None:
    """A link to docs/PAGE.md#anchor needs the page and, on it, the anchor the site gives it."""
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines; at most {README_MAX_LINES}: the rest belongs in docs/"
    )
    text = "\n".join(lines)
    targets = re.findall(r"\]\(\s*(?:\./)?(docs/[^)\s]*)", text)
    targets += re.findall(r"^\s*\[[^\]]+\]:\s*(?:\./)?(docs/\S*)", text, re.M)
    broken = []
    for target in sorted(set(targets)):
        path, _, anchor = target.partition("#")
        if not (ROOT / path).exists():
            broken.append(target)
        elif anchor and path.endswith(".md") and anchor not in _anchors(ROOT / path):
            broken.append(target)
    assert not broken, f"README.md links to what docs/ does not have: {broken}"


def _anchors(page: Path) -> set[str]:
    """The ids a page of the site has: its headings' and those given with {#id}."""
    import markdown  # mkdocs's, from the dev extra

    html = markdown.markdown(
        page.read_text(),
        extensions=["toc", "attr_list", "tables", "md_in_html", "admonition"],
    )
    return set(re.findall(r'\bid="([^"]+)"', html))


def test_a_block_said_to_run_in_a_test_must_be_run_by_it(tmp_path, monkeypatch) -> None:
    pasted = 'from transformers import pipeline\npipeline("text-generation", model="m")\n'
    runs = dataclasses.replace(_block(pasted, "python"), page="docs/export.md")
    _check_python(dataclasses.replace(runs, runs_in="tests/test_export.py"), tmp_path, monkeypatch)
    for runner in ("tests/test_docs.py", "tests/no_such_test.py"):
        with pytest.raises(AssertionError, match=f"runs in: {runner} --> but that file runs no"):
            _check_python(dataclasses.replace(runs, runs_in=runner), tmp_path, monkeypatch)
    with pytest.raises(NameError):  # an unmarked block runs, here
        _check_python(_block("undefined_name\n", "python"), tmp_path, monkeypatch)
