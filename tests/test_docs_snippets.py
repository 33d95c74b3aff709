"""Every Python block of README.md and docs/index.md runs as written, so the snippets stay true."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def _blocks() -> list[tuple[str, str]]:
    found = []
    for name in ("README.md", "docs/index.md"):
        for i, code in enumerate(BLOCK.findall((ROOT / name).read_text())):
            found.append((f"{name}#{i}", code))
    return found


@pytest.mark.parametrize(("where", "code"), _blocks(), ids=[w for w, _ in _blocks()])
def test_snippet_runs(where: str, code: str) -> None:
    exec(compile(code, where, "exec"), {"__name__": "__snippet__"})


def test_there_are_snippets_to_run() -> None:
    assert {w.split("#")[0] for w, _ in _blocks()} == {"README.md", "docs/index.md"}
