"""Writes the text jobs/mix.yaml streams: two sources taken from Python's own standard library,
present wherever qgtrain runs (as the built-in corpus is), so the example downloads nothing.

  docs: the docstrings of the standard library's modules, classes and functions, one document each
  code: the modules' source, one document each

Each source is dealt round-robin into --files JSON Lines files: a streamed source is read in whole
files (shards of up to 16 MB), and every reading slot (rank x loader worker) needs one of each
source, so 8 files serve up to 8 slots (4 ranks with data.num_workers: 2). Run from the repository
root; the files go under data/ (ignored by git, like the token caches):

    python jobs/examples/mix_data.py                 # data/mix/{docs,code}/part-NN.jsonl
    python jobs/examples/mix_data.py --mb 64 --files 32
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

SKIPPED = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def modules() -> Iterator[tuple[Path, str]]:
    """Every module of the standard library that parses, in a fixed order, with its source."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        if SKIPPED & set(path.relative_to(stdlib).parts):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            yield path, source
        except (OSError, UnicodeDecodeError):
            continue


def docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    found = [ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, kinds)]
    return [text for text in found if text and len(text) > 40]


def write(folder: Path, documents: Iterator[str], limit: int, files: int) -> int:
    """Up to `limit` bytes of the documents, dealt round-robin into `files` files."""
    folder.mkdir(parents=True, exist_ok=True)
    outs = [open(folder / f"part-{index:02d}.jsonl", "w") for index in range(files)]
    written = count = 0
    try:
        for text in documents:
            if written >= limit:
                break
            outs[count % files].write(json.dumps({"text": text}) + "\n")
            written, count = written + len(text.encode()), count + 1
    finally:
        for out in outs:
            out.close()
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/mix"))
    parser.add_argument("--mb", type=float, default=4.0, help="megabytes of text per source")
    parser.add_argument("--files", type=int, default=8, help="files per source")
    args = parser.parse_args()
    limit = int(args.mb * 1e6)
    docs = (text for _, source in modules() for text in docstrings(source))
    code = (source for _, source in modules() if source.strip())
    for name, documents in (("docs", docs), ("code", code)):
        count = write(args.out / name, documents, limit, args.files)
        print(f"{args.out / name}: {count} documents in {args.files} files")


if __name__ == "__main__":
    main()
