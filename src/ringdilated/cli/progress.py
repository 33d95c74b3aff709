"""A dependency-free progress bar on standard error (silent when it is not a terminal unless
asked), and the plain-text table every command prints."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

__all__ = ["progress", "table"]

T = TypeVar("T")


def progress(items: Sequence[T], label: str, *, enabled: bool = True) -> Iterator[T]:
    """Yield ``items``, drawing ``label [#####.....] i/n`` on stderr as they complete."""
    total = len(items)
    width = 30

    def draw(done: int, current: str) -> None:
        if not enabled:
            return
        filled = width * done // max(1, total)
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\r{label} [{bar}] {done}/{total} {current[:40]:<40}")
        sys.stderr.flush()

    for i, item in enumerate(items):
        draw(i, str(item))
        yield item
    draw(total, "done")
    if enabled:
        sys.stderr.write("\n")


def table(rows: Iterable[Sequence[object]], header: Sequence[str]) -> str:
    """Left-aligned columns separated by two spaces."""
    cells = [[str(h) for h in header], *([str(c) for c in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
