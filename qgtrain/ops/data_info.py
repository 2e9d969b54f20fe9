"""`qgtrain data info`: what the token caches in a folder hold, and whether their source files have
changed. A cache or data folder may be shared, so what its meta.json says and the names of its
files are shown escaped (foundation/terminal.py); --json escapes them as JSON does."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..config import DataConfig
from ..data.files.sources import SourceFile, find
from ..foundation.errors import ConfigError
from ..foundation.terminal import shown


def describe(path: Path) -> list[dict[str, Any]]:
    """One entry per cache entry: `path` itself, or each entry inside a cache folder."""
    if (path / "meta.json").is_file():
        return [_entry(path)]
    if not path.is_dir():
        raise ConfigError(f"{path}: no such cache folder (data.cache_dir) or cache entry")
    entries = [
        _entry(folder) for folder in sorted(path.iterdir()) if (folder / "meta.json").is_file()
    ]
    unfinished = [
        {"folder": str(folder), "unfinished": True} for folder in sorted(path.glob("*.tmp-*"))
    ]
    return entries + unfinished


def render(entries: list[dict[str, Any]]) -> str:
    lines = []
    for entry in entries:
        if entry.get("unfinished"):
            lines += [
                f"{entry['folder']}: unfinished (a job is tokenizing into it, or was killed; the "
                "next preparation removes it)",
                "",
            ]
            continue
        splits = ("train", "val", "test")
        lines.append(
            f"{entry['folder']} ({entry['kind']}, tokenizer {entry['tokenizer']}, "
            f"{entry['dtype']}, {entry['mb_on_disk']:.1f} MB)"
        )
        documents = entry["documents"]
        lines.append(
            f"  documents: {documents['all']:,} in all"
            if "all" in documents
            else "  documents: " + ", ".join(f"{s} {documents.get(s, 0):,}" for s in splits)
        )
        lines.append(
            "  tokens:    " + ", ".join(f"{s} {entry['tokens'].get(s, 0):,}" for s in splits)
        )
        for split, files in entry["sources"].items():
            named = ", ".join(f["path"] for f in files[:3]) + (
                f" and {len(files) - 3} more" if len(files) > 3 else ""
            )
            lines.append(
                f"  {split} files: {len(files)} ({named})"
                if files
                else f"  {split}: held out of the train files "
                f"({100 * entry['held_out'].get(split, 0):g}%)"
            )
        if entry.get("corpus"):
            lines.append(f"  corpus:    {entry['corpus']}")
        if entry.get("created"):
            lines.append(
                f"  made:      {time.strftime('%Y-%m-%d %H:%M', time.localtime(entry['created']))} "
                f"in {entry['seconds']:.1f} s"
            )
        changed = entry["changed"]
        lines.append(
            "  current:   "
            + (
                "yes, its files are unchanged"
                if not changed
                else f"no: {len(changed)} file(s) changed since, e.g. {changed[0]}; "
                "the next job prepares a new entry"
            )
        )
        lines.append("")
    streamed = (
        "no token caches here (a run with data.stream: true reads its data files while "
        "training, without one)"
    )
    return "\n".join(map(shown, lines)).rstrip() if lines else streamed


def configured(data: DataConfig) -> list[str]:
    """What the configured data files are read as, above the caches: for data.mix each source's
    weight, share and files, so a mixture is checked before a job spends an allocation on it."""
    if data.name != "files":
        return []
    how = "streamed while training (data.stream)" if data.stream else "tokenized into the cache"
    if not data.mix:
        return [f"data.files: {_shown(find(data.files, 'data.files'))}, {how}", ""]
    total = sum(float(source["weight"]) for source in data.mix)
    lines = [f"data.mix: {len(data.mix)} sources, {how}"]
    for index, source in enumerate(data.mix):
        patterns = [source["files"]] if isinstance(source["files"], str) else source["files"]
        files = find(patterns, f"data.mix[{index}].files (source {source['name']!r})")
        share = 100 * float(source["weight"]) / total
        lines.append(
            f"  {source['name']}: weight {source['weight']:g} ({share:.0f}%), {_shown(files)}"
        )
    return [*lines, ""]


def _shown(files: list[SourceFile]) -> str:
    names = ", ".join(shown(Path(f.path).name) for f in files[:3])
    more = f" and {len(files) - 3} more" if len(files) > 3 else ""
    return f"{len(files)} file(s) ({names}{more})"


def _entry(folder: Path) -> dict[str, Any]:
    try:
        meta = json.loads((folder / "meta.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{folder / 'meta.json'}: not a readable cache description ({exc})"
        ) from None
    sources: dict[str, list[dict[str, Any]]] = meta.get("sources", {})
    changed = [f["path"] for files in sources.values() for f in files if _changed(f)]
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    return {
        "folder": str(folder),
        "kind": meta.get("kind", "corpus"),
        "tokenizer": meta.get("tokenizer"),
        "dtype": meta.get("dtype"),
        "documents": _per_split(meta.get("documents")),
        "tokens": meta["tokens"],
        "sources": sources,
        "held_out": meta.get("held_out", {}),
        "corpus": meta.get("corpus"),
        "created": meta.get("created"),
        "seconds": meta.get("seconds", 0.0),
        "changed": changed,
        "mb_on_disk": size / 1e6,
    }


def _per_split(documents: Any) -> dict[str, int]:
    return documents if isinstance(documents, dict) else {"all": documents} if documents else {}


def _changed(file: dict[str, Any]) -> bool:
    try:
        return not SourceFile(**file).unchanged()
    except OSError:  # removed since
        return True
