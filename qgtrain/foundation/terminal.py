"""Text read from files and folders other users can write, as it may reach a terminal.

Run directories, results files, task files and caches sit on shared filesystems, so whoever could
write them writes what `qgtrain runs`, `eval`, `data info`, `doctor` and the one error line print:
an escape sequence there would recolour, clear or retitle the terminal (or, on some terminals, write
into its input), and a line break would add lines that pose as qgtrain's own. Every such text is
printed through `shown`, which writes those characters as their escapes instead.
"""

from __future__ import annotations


def shown(text: str) -> str:
    """`text` with every character a terminal would act on instead of print (C0 and C1 controls,
    DEL, line and paragraph separators, bidirectional overrides) written as its Python escape: one
    row stays one line."""
    return "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )
