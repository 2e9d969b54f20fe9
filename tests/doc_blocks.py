"""The fenced code blocks of README.md and docs/, for the tests that check or run them.

A block says its language on its opening fence (```python, ```yaml, ...). The line directly above
it may say what it needs (`<!-- needs: slurm -->`, or gpu, network; several separated by commas),
or which test runs it (`<!-- runs in: tests/test_export.py -->`): a block whose example needs what
a test builds anyway (a run, an export, a base model) is run there, found by `python_block`, with
the page's own text."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
GENERATED = ("configuration.md", "cli.md")

NEEDS_MARK = re.compile(r"\s*<!--\s*needs:\s*(?P<what>.*?)\s*-->\s*")
RUNS_MARK = re.compile(r"\s*<!--\s*runs in:\s*(?P<test>tests/\S+\.py)\s*-->\s*")
ALIASES = {"py": "python", "python3": "python", "yml": "yaml", "shell": "bash", "zsh": "bash"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
# how a test names the block it runs: python_block("docs/export.md", "text in the block")
RUN_CALL = re.compile(
    r"python_block\(\s*\"(?P<page>[^\"]+)\",\s*(?P<quote>['\"])(?P<snippet>.+?)(?P=quote)"
)


@dataclasses.dataclass(frozen=True)
class Block:
    page: str  # relative to the repository root
    line: int  # of the opening fence, from 1
    language: str
    text: str
    needs: frozenset[str]
    closed: bool
    runs_in: str = ""  # the test file that runs it, where a mark above names one

    def where(self, offset: int = -1) -> str:
        """The page and line of the block's opening fence, or of its line at `offset`."""
        return f"{self.page}:{self.line + 1 + offset if offset >= 0 else self.line}"


def pages() -> list[Path]:
    """The Markdown a reader copies from: README.md and docs/, less the generated pages."""
    written = [p for p in sorted(DOCS.glob("*.md")) if p.name not in GENERATED]
    return [README, *written]


def code_blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, with the language each says it is and what the
    comment directly above it says it needs."""
    lines = path.read_text().splitlines()
    blocks, index = [], 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening or "`" in opening["info"]:
            index += 1
            continue
        end = next((j for j in range(index + 1, len(lines)) if _closes(lines[j], opening)), None)
        body = lines[index + 1 : end]
        indent = len(opening["indent"])
        # a block in a list item or an admonition: its lines as the fence is indented
        text = "\n".join(
            line[indent:] if not line[:indent].strip() else line.lstrip() for line in body
        )
        above = lines[index - 1] if index else ""
        mark = NEEDS_MARK.fullmatch(above)
        needs = frozenset(re.split(r"[\s,]+", mark["what"])) if mark else frozenset()
        runner = RUNS_MARK.fullmatch(above)
        blocks.append(
            Block(
                page=str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name),
                line=index + 1,
                language=_language(opening["info"]),
                text=text + "\n" if body else "",
                needs=needs,
                closed=end is not None,
                runs_in=runner["test"] if runner else "",
            )
        )
        index = len(lines) if end is None else end + 1
    return blocks


def _closes(line: str, opening: re.Match[str]) -> bool:
    fence = opening["fence"]
    stripped = line.strip()
    return stripped.startswith(fence) and set(stripped) == {fence[0]}


def _language(info: str) -> str:
    """The language an opening fence names: ```python, ``` python title="x", ```{.python}."""
    words = info.strip().lstrip("{").split()
    word = words[0].lstrip(".").rstrip("}").lower() if words else ""
    return ALIASES.get(word, word)


def python_block(page: str, snippet: str) -> str:
    """The text of the one python block of `page` (README.md, docs/x.md) that holds `snippet`."""
    found = [
        block.text
        for block in code_blocks(ROOT / page)
        if block.language == "python" and snippet in block.text
    ]
    assert len(found) == 1, f"{page}: {len(found)} python blocks hold {snippet!r}; update the test"
    return found[0]


def run_by(test: Path) -> list[tuple[str, str]]:
    """The (page, snippet) of each block a test file runs through python_block."""
    return [(m["page"], m["snippet"]) for m in RUN_CALL.finditer(test.read_text())]
