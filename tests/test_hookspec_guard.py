"""Guards: every hookspec is documented in the plugin guide and exercised here, by registering a
plugin that implements it and finding what it offered in the registry. A new hookspec fails
these tests until it has both."""

from __future__ import annotations

import inspect
import pathlib
import types
from collections.abc import Callable
from typing import Any

import attrs
import pytest

from ringdilated.backends.local import LOCAL_SPEC
from ringdilated.backends.reference import REFERENCE_SPEC
from ringdilated.plugins import PluginRegistry, build_registry, hookimpl, hookspecs

GUIDE = pathlib.Path(__file__).parents[1] / "docs" / "plugins.md"
HOOKSPECS = sorted(
    name
    for name, fn in inspect.getmembers(hookspecs, inspect.isfunction)
    if hasattr(fn, "ringdilated_spec")
)

# hook name -> (a spec the fake plugin offers, how to find it in the registry)
EXERCISES: dict[str, tuple[Any, Callable[[PluginRegistry], dict[str, Any]]]] = {
    "ringdilated_kernels": (
        attrs.evolve(REFERENCE_SPEC, name="guard-kernel"),
        lambda r: r.kernels,
    ),
    "ringdilated_communicators": (
        attrs.evolve(LOCAL_SPEC, name="guard-communicator"),
        lambda r: r.communicators,
    ),
}


def test_hookspecs_are_found() -> None:
    assert HOOKSPECS == ["ringdilated_communicators", "ringdilated_kernels"]


@pytest.mark.parametrize("hook", HOOKSPECS)
def test_every_hookspec_is_documented(hook: str) -> None:
    assert f"`{hook}`" in GUIDE.read_text(), f"docs/plugins.md does not document {hook}"


@pytest.mark.parametrize("hook", HOOKSPECS)
def test_every_hookspec_is_exercised(hook: str) -> None:
    assert hook in EXERCISES, f"no exercise for hookspec {hook}: add one to EXERCISES"
    spec, found = EXERCISES[hook]
    plugin = types.SimpleNamespace(**{hook: hookimpl(lambda: [spec])})

    class EntryPoint:
        name, value, dist = "guard", "guard.module", None

        def load(self) -> object:
            return plugin

    registry = build_registry(entry_points=lambda: (EntryPoint(),))
    assert found(registry)[spec.name] is spec
