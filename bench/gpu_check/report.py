"""The check's results: one line per check as it finishes, and one markdown table at the end for the
README. A check is PASS or FAIL on a condition that can go either way, or SKIP with the reason it
could not run here (never a PASS for what cannot fail)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Result:
    verdict: str  # PASS, FAIL or SKIP
    name: str
    figure: str = ""  # the number behind the verdict: a ratio, GB, seconds
    detail: str = ""  # what to look at when it failed: the condition, a log's tail


@dataclass
class Report:
    device: str
    torch_version: str
    results: list[Result] = field(default_factory=list)

    def check(self, ok: bool, name: str, figure: str = "", detail: str = "") -> bool:
        return self._add(Result("PASS" if ok else "FAIL", name, figure, detail))

    def skip(self, name: str, why: str) -> bool:
        return self._add(Result("SKIP", name, "", why))

    def _add(self, result: Result) -> bool:
        self.results.append(result)
        shown = " ".join("; ".join(part for part in (result.figure, result.detail) if part).split())
        print(f"{result.verdict}  {result.name}{': ' + shown if shown else ''}", flush=True)
        return result.verdict != "FAIL"

    @property
    def failed(self) -> list[str]:
        return [r.name for r in self.results if r.verdict == "FAIL"]

    def table(self) -> str:
        """The summary to paste into the README; a cell never breaks the table (pipes and
        newlines)."""
        rows = ["| check | result | figure | device | torch |", "|---|---|---|---|---|"]
        for r in self.results:
            figure = r.figure if r.verdict != "SKIP" else r.detail
            rows.append(
                "| "
                + " | ".join(
                    _cell(v) for v in (r.name, r.verdict, figure, self.device, self.torch_version)
                )
                + " |"
            )
        return "\n".join(rows)

    def summary(self) -> str:
        counts = {v: sum(r.verdict == v for r in self.results) for v in ("PASS", "FAIL", "SKIP")}
        return f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped" + (
            f"; failed: {', '.join(self.failed)}" if self.failed else ""
        )


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")[:160]
