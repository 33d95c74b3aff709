"""The plugin layer: built-ins through the hooks, entry points, isolation of broken plugins."""

from __future__ import annotations

import types
from collections.abc import Callable

import attrs
import pytest

from ringdilated.backends.reference import REFERENCE_SPEC
from ringdilated.backends.sdpa import SDPA_SPEC
from ringdilated.core import KernelSpec
from ringdilated.plugins import (
    PluginError,
    PluginInfo,
    PluginWarning,
    build_registry,
    hookimpl,
    load_registry,
)
from ringdilated.plugins.builtins import BUILTIN_PLUGINS

BUILTIN_KERNELS = {"sdpa", "reference", "flash", "xformers", "flex"}


@attrs.frozen
class FakeDist:
    name: str
    version: str


@attrs.frozen
class FakeEntryPoint:
    """Duck-types importlib.metadata.EntryPoint: name, value, dist, load()."""

    name: str
    loader: Callable[[], object]
    value: str = "fake.module"
    dist: FakeDist | None = FakeDist("fake-dist", "1.2.3")

    def load(self) -> object:
        return self.loader()


def _plugin(specs: Callable[[], object]) -> types.SimpleNamespace:
    return types.SimpleNamespace(ringdilated_kernels=hookimpl(specs))


def _spec(name: str) -> KernelSpec:
    return attrs.evolve(REFERENCE_SPEC, name=name, priority=-1)


def _registry(*eps: FakeEntryPoint, **kw: object):
    return build_registry(entry_points=lambda: eps, **kw)


def test_builtins_register_through_the_hooks() -> None:
    registry = build_registry(entry_points=lambda: ())
    assert set(registry.kernels) == BUILTIN_KERNELS
    assert registry.origins["sdpa"] == "ringdilated.backends.sdpa (built-in)"
    assert registry.failures == ()
    assert set(registry.communicators) == {"local", "ringpass", "allgather", "ulysses", "hybrid"}
    assert registry.communicator_origins["ringpass"] == "ringdilated.backends.ringpass (built-in)"
    names = {registry.manager.get_name(p) for p in registry.manager.get_plugins()}
    assert names == {p.name for p in BUILTIN_PLUGINS}


def test_entry_point_plugin_is_loaded_with_its_origin() -> None:
    ep = FakeEntryPoint("good", lambda: _plugin(lambda: [_spec("extra")]))
    registry = _registry(ep)
    assert "extra" in registry.kernels
    assert registry.origins["extra"] == "good (entry point 'good' (fake-dist 1.2.3))"


def _raise_import() -> object:
    raise ImportError("No module named 'missing_dep'")


def _raise_in_hook() -> list[KernelSpec]:
    raise RuntimeError("boom")


@pytest.mark.parametrize(
    ("ep", "message"),
    [
        (
            FakeEntryPoint("broken", _raise_import),
            "plugin 'broken' skipped: import of 'fake.module' failed: ImportError",
        ),
        (
            FakeEntryPoint("raiser", lambda: _plugin(_raise_in_hook)),
            "plugin 'raiser' skipped: ringdilated_kernels() raised RuntimeError: boom",
        ),
        (
            FakeEntryPoint("liar", lambda: _plugin(lambda: ["not a spec"])),
            "plugin 'liar' skipped: ringdilated_kernels() must return a list of KernelSpec",
        ),
        (
            FakeEntryPoint("dup", lambda: _plugin(lambda: [_spec("sdpa")])),
            "plugin 'dup' skipped: KernelSpec name 'sdpa' from dup (entry point 'dup' "
            "(fake-dist 1.2.3)) is already provided by ringdilated.backends.sdpa (built-in)",
        ),
    ],
)
def test_failing_plugin_is_isolated_and_reported(ep: FakeEntryPoint, message: str) -> None:
    good = FakeEntryPoint("good", lambda: _plugin(lambda: [_spec("extra")]))
    with pytest.warns(PluginWarning, match=message.replace("(", r"\(").replace(")", r"\)")):
        registry = _registry(ep, good)
    assert {"sdpa", "reference", "extra"} <= set(registry.kernels)
    assert registry.kernels["sdpa"] is SDPA_SPEC, "a plugin never replaces a built-in"
    assert registry.origins["sdpa"] == "ringdilated.backends.sdpa (built-in)"
    assert len(registry.failures) == 1 and registry.failures[0].startswith(message)


def test_failures_reach_explain() -> None:
    from ringdilated import Request, Resolver

    with pytest.warns(PluginWarning):
        registry = _registry(FakeEntryPoint("broken", _raise_import))
    plan = Resolver(registry.kernels.values(), plugin_failures=registry.failures).resolve(Request())
    assert "plugin failed: plugin 'broken' skipped" in plan.explain()


def test_autoload_off_never_lists_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    def never() -> tuple:
        raise AssertionError("entry points must not be listed with autoload off")

    monkeypatch.setenv("RINGDILATED_DISABLE_PLUGIN_AUTOLOAD", "1")
    registry = build_registry(entry_points=never)
    assert set(registry.kernels) == BUILTIN_KERNELS
    registry = build_registry(entry_points=never, autoload=False)
    assert set(registry.kernels) == BUILTIN_KERNELS


def test_blocked_plugins_are_not_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    good = FakeEntryPoint("good", lambda: _plugin(lambda: [_spec("extra")]))
    monkeypatch.setenv("RINGDILATED_BLOCK_PLUGINS", "good, ringdilated.backends.sdpa")
    registry = _registry(good)
    assert set(registry.kernels) == BUILTIN_KERNELS - {"sdpa"}
    assert set(_registry(good, blocked=()).kernels) == BUILTIN_KERNELS | {"extra"}


def test_default_registry_is_cached() -> None:
    assert load_registry() is load_registry()
    assert {"sdpa", "reference"} <= set(load_registry().kernels)


def test_duplicate_names_across_distributions_name_both() -> None:
    first = FakeEntryPoint(
        "a", lambda: _plugin(lambda: [_spec("fast")]), dist=FakeDist("dist-a", "1.0")
    )
    second = FakeEntryPoint(
        "b", lambda: _plugin(lambda: [_spec("fast")]), dist=FakeDist("dist-b", "2.0")
    )
    with pytest.warns(PluginWarning) as caught:
        registry = _registry(first, second)
    assert registry.origins["fast"] == "a (entry point 'a' (dist-a 1.0))"
    message = str(caught[0].message)
    assert "dist-a 1.0" in message and "dist-b 2.0" in message


def test_only_allowed_plugins_are_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    one = FakeEntryPoint("one", lambda: _plugin(lambda: [_spec("k1")]))
    two = FakeEntryPoint("two", lambda: _plugin(lambda: [_spec("k2")]))
    assert set(_registry(one, two, allowed=["two"]).kernels) == BUILTIN_KERNELS | {"k2"}
    monkeypatch.setenv("RINGDILATED_ALLOW_PLUGINS", "one")
    assert set(_registry(one, two).kernels) == BUILTIN_KERNELS | {"k1"}
    assert set(_registry(one, two, allowed=()).kernels) == BUILTIN_KERNELS | {"k1", "k2"}


def test_strict_mode_raises_instead_of_skipping(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = FakeEntryPoint("broken", _raise_import)
    with pytest.raises(PluginError, match=r"plugin 'broken' failed \(strict mode\): import"):
        _registry(broken, strict=True)
    monkeypatch.setenv("RINGDILATED_STRICT_PLUGINS", "1")
    with pytest.raises(PluginError, match="already provided by"):
        _registry(FakeEntryPoint("dup", lambda: _plugin(lambda: [_spec("sdpa")])))
    with pytest.warns(PluginWarning):
        _registry(broken, strict=False)


def test_listing_names_distributions_versions_and_failures() -> None:
    good = FakeEntryPoint("good", lambda: _plugin(lambda: [_spec("extra")]))
    with pytest.warns(PluginWarning):
        registry = _registry(good, FakeEntryPoint("broken", _raise_import))
    info = {p.name: p for p in registry.plugins}
    assert info["good"] == PluginInfo("good", "entry point", "fake-dist", "1.2.3", ("extra",))
    assert info["ringdilated.backends.ringpass"].communicators == ("ringpass",)
    assert info["ringdilated.backends.sdpa"].distribution == "ringdilated"
    table = registry.describe()
    assert "good" in table and "fake-dist 1.2.3" in table and "extra" in table
    assert "failed: plugin 'broken' skipped: import of 'fake.module' failed" in table
