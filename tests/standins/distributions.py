"""Installed distributions as ``importlib.metadata`` reports them, faked for a stand-in package: a
wrapper reads a version from metadata without importing the package, so a stand-in put in
``sys.modules`` also needs its distribution to be seen (or, to stand for a build installed under
another name, not seen)."""

from __future__ import annotations

import importlib.metadata
import re

import pytest

__all__ = ["fake_distributions"]


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def fake_distributions(monkeypatch: pytest.MonkeyPatch, versions: dict[str, str | None]) -> None:
    """Make ``importlib.metadata.version(name)`` answer ``versions[name]`` (``None``: not
    installed) for the names given, normalized as PEP 503 does; other names as before."""
    real = importlib.metadata.version
    table = {_normalized(name): version for name, version in versions.items()}

    def version(name: str) -> str:
        key = _normalized(name)
        if key not in table:
            return real(name)
        found = table[key]
        if found is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return found

    monkeypatch.setattr(importlib.metadata, "version", version)
