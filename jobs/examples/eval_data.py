"""Writes the downstream tasks jobs/eval.yaml scores, from Python's own standard library (what the
built-in corpus is made of), so the example downloads nothing:

  next_line.jsonl  multiple_choice: a function's first lines, and four candidates for the line
                   that follows (the right one and three lines of other functions)
  complete.jsonl   generate: the start of a line of code, the rest of the line as the answer
  modules.jsonl    perplexity: whole modules of one package (email), as held-out text

The built-in corpus trains on the standard library too, so these measure memory as much as skill:
point them at your own held-out code or text for a real benchmark. Run from the repository root;
the files go under data/ (ignored by git):

    python jobs/examples/eval_data.py                # data/eval/*.jsonl, 200 items each
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sysconfig
from pathlib import Path

SKIPPED = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def functions(most_modules: int) -> list[list[str]]:
    """The source lines of every function with at least four of the standard library's first
    `most_modules` modules (0 = all), in a fixed order."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    found = []
    paths = [
        p for p in sorted(stdlib.rglob("*.py")) if not SKIPPED & set(p.relative_to(stdlib).parts)
    ]
    for path in paths[: most_modules or None]:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.end_lineno:
                body = [line for line in lines[node.lineno - 1 : node.end_lineno] if line.strip()]
                if len(body) >= 4:
                    found.append(body)
    return found


def next_line(bodies: list[list[str]], count: int, rng: random.Random) -> list[dict[str, object]]:
    items = []
    for body in rng.sample(bodies, count):
        cut = rng.randrange(2, len(body))
        others = [rng.choice(rng.choice(bodies)) for _ in range(3)]
        choices = [body[cut], *others]
        rng.shuffle(choices)
        context = "\n".join(body[:cut]) + "\n"
        items.append({"context": context, "choices": choices, "label": choices.index(body[cut])})
    return items


def complete(bodies: list[list[str]], count: int, rng: random.Random) -> list[dict[str, object]]:
    items = []
    for body in rng.sample(bodies, count):
        line = rng.choice([text for text in body[1:] if len(text.strip()) > 12] or body[1:])
        half = len(line) // 2
        prompt = "\n".join(body[: body.index(line)] + [line[:half]])
        items.append({"prompt": prompt, "answer": line[half:]})
    return items


def modules(count: int) -> list[dict[str, object]]:
    """The first 2000 characters of each module: enough text, a short enough evaluation."""
    package = Path(sysconfig.get_paths()["stdlib"]) / "email"
    return [{"text": path.read_text()[:2000]} for path in sorted(package.glob("*.py"))[:count]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("data/eval"))
    parser.add_argument("--items", type=int, default=200, help="items per task")
    parser.add_argument("--modules", type=int, default=0, help="modules read (0 = all)")
    args = parser.parse_args()
    rng = random.Random(0)
    bodies = functions(args.modules)
    args.out.mkdir(parents=True, exist_ok=True)
    tasks = {
        "next_line": next_line(bodies, args.items, rng),
        "complete": complete(bodies, args.items, rng),
        "modules": modules(args.items),
    }
    for name, rows in tasks.items():
        path = args.out / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(f"{path}: {len(rows)} items")


if __name__ == "__main__":
    main()
