"""The plugin layer: built-ins through the hooks, entry points, isolation of broken plugins."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import types
from collections.abc import Callable, Iterator
from xml.etree import ElementTree

import attrs
import pytest
import torch

import ringdilated
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

BUILTIN_KERNELS = {
    "sdpa",
    "torch_flash",
    "cudnn",
    "reference",
    "flash",
    "flash3",
    "flash4",
    "xformers",
    "flex",
}


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
    with pytest.warns(
        PluginWarning, match=message.replace("(", r"\(").replace(")", r"\)")
    ) as caught:
        registry = _registry(ep, good)
    # the warning names the user's line (here, this test's), not a line of ringdilated's (a
    # fixed stacklevel=3 named one inside the plugin manager)
    assert {w.filename for w in caught if w.category is PluginWarning} == {__file__}
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


# Issue 21, item 6: configuration is never silently ignored. Every switch is read by one strict
# parser (ringdilated.core.support.env.env_flag), every name list is checked against what exists.

SWITCH_SPELLINGS = r"\('1', 'true', 'yes', 'on', '0', 'false', 'no', 'off'\) \(any case\)"


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("RINGDILATED_STRICT_PLUGINS", "2"),
        ("RINGDILATED_STRICT_PLUGINS", "yes-please"),
        ("RINGDILATED_DISABLE_PLUGIN_AUTOLOAD", "maybe"),
    ],
)
def test_a_switch_that_is_not_understood_raises_naming_it(
    variable: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"^{variable} must be one of {SWITCH_SPELLINGS}") as info:
        _registry()
    assert f"got {value!r}" in str(info.value)


@pytest.mark.parametrize(
    ("value", "on"),
    [
        *[("1", True), (" TRUE ", True), ("Yes", True), ("on", True)],
        *[("0", False), ("false", False), ("NO", False), ("off", False), ("", False)],
    ],
)
def test_every_accepted_switch_spelling_works(
    value: str, on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ringdilated.core.call.sequence_layout import agree_every_call_default

    good = FakeEntryPoint("good", lambda: _plugin(lambda: [_spec("extra")]))
    monkeypatch.setenv("RINGDILATED_DISABLE_PLUGIN_AUTOLOAD", value)
    assert ("extra" in _registry(good).kernels) is not on
    monkeypatch.delenv("RINGDILATED_DISABLE_PLUGIN_AUTOLOAD")
    monkeypatch.setenv("RINGDILATED_STRICT_PLUGINS", value)
    broken = FakeEntryPoint("broken", _raise_import)
    if on:
        with pytest.raises(PluginError, match="strict mode"):
            _registry(broken)
    else:
        with pytest.warns(PluginWarning):
            _registry(broken)
    monkeypatch.setenv("RINGDILATED_AGREE_EVERY_CALL", value)
    assert agree_every_call_default() is on


def test_the_agreement_switch_shares_the_strict_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringdilated.core.call.sequence_layout import agree_every_call_default

    monkeypatch.setenv("RINGDILATED_AGREE_EVERY_CALL", "2")
    with pytest.raises(ValueError, match=r"^RINGDILATED_AGREE_EVERY_CALL must be one of "):
        agree_every_call_default()


@pytest.mark.parametrize("name", ["flex", "ringdilated.backends.flex"])
def test_a_builtin_is_blocked_by_its_short_or_module_name(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RINGDILATED_BLOCK_PLUGINS", name)
    assert set(_registry().kernels) == BUILTIN_KERNELS - {"flex"}
    assert set(_registry(blocked=[name]).kernels) == BUILTIN_KERNELS - {"flex"}


@pytest.mark.parametrize("name", ["reference", "local", "ringdilated.backends.reference"])
def test_an_essential_builtin_cannot_be_blocked_by_any_of_its_names(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``reference`` is the name the docs use: it raised nothing and blocked nothing."""
    monkeypatch.setenv("RINGDILATED_BLOCK_PLUGINS", f"flex,{name}")
    with pytest.raises(PluginError, match=rf"plugin\(s\) '{name}' .*cannot be blocked") as info:
        _registry()
    assert "RINGDILATED_BLOCK_PLUGINS=" in str(info.value)
    with pytest.raises(PluginError, match="cannot be blocked"):
        _registry(blocked=[name])


def test_a_misspelt_blocked_name_raises_naming_what_exists(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    good = FakeEntryPoint("good", lambda: _plugin(lambda: [_spec("extra")]))
    monkeypatch.setenv("RINGDILATED_BLOCK_PLUGINS", "good,flexx")
    with pytest.raises(ValueError, match=r"^RINGDILATED_BLOCK_PLUGINS='good,flexx'") as info:
        _registry(good)
    message = str(info.value)
    assert message.startswith(
        "RINGDILATED_BLOCK_PLUGINS='good,flexx' names 'flexx', not a built-in plugin (module or "
        "short name) or an installed entry point; accepted: "
    )
    for accepted in ("flex", "good", "reference", "ringdilated.backends.flex", "sdpa"):
        assert accepted in message.split("accepted: ")[1]


def test_a_blocked_entry_point_is_checked_even_with_autoload_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    good = FakeEntryPoint("good", lambda: _plugin(lambda: [_spec("extra")]))
    monkeypatch.setenv("RINGDILATED_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("RINGDILATED_BLOCK_PLUGINS", "good")
    assert set(_registry(good).kernels) == BUILTIN_KERNELS
    monkeypatch.setenv("RINGDILATED_BLOCK_PLUGINS", "goood")
    with pytest.raises(ValueError, match="names 'goood', not a built-in plugin"):
        _registry(good)


def test_a_misspelt_allowed_name_raises_naming_the_entry_points(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    one = FakeEntryPoint("one", lambda: _plugin(lambda: [_spec("k1")]))
    two = FakeEntryPoint("two", lambda: _plugin(lambda: [_spec("k2")]))
    monkeypatch.setenv("RINGDILATED_ALLOW_PLUGINS", "one, tow")
    with pytest.raises(
        ValueError,
        match=r"^RINGDILATED_ALLOW_PLUGINS='one, tow' names 'tow', not an installed entry "
        r"point; accepted: one, two \(comma-separated\)$",
    ):
        _registry(one, two)
    monkeypatch.setenv("RINGDILATED_ALLOW_PLUGINS", "sdpa")
    with pytest.raises(ValueError, match="built-ins always load unless RINGDILATED_BLOCK_PLUGINS"):
        _registry(one, two)


def test_names_given_as_arguments_are_taken_as_given() -> None:
    one = FakeEntryPoint("one", lambda: _plugin(lambda: [_spec("k1")]))
    assert set(_registry(one, allowed=["elsewhere"]).kernels) == BUILTIN_KERNELS
    assert set(_registry(one, blocked=["elsewhere"]).kernels) == BUILTIN_KERNELS | {"k1"}


@pytest.fixture
def fresh_default_resolver() -> Iterator[None]:
    from ringdilated.registry import default_resolver

    load_registry.cache_clear()
    default_resolver.cache_clear()
    yield
    load_registry.cache_clear()
    default_resolver.cache_clear()


def test_a_misspelt_package_raises_naming_the_packages_kernels_require(
    monkeypatch: pytest.MonkeyPatch, fresh_default_resolver: None
) -> None:
    from ringdilated.registry import default_resolver

    monkeypatch.setenv("RINGDILATED_PACKAGES", "flash-attn,xformers")
    with pytest.raises(
        ValueError,
        match=r"^RINGDILATED_PACKAGES='flash-attn,xformers' names 'flash-attn', not a package a "
        r"kernel requires; accepted: flash_attn, flash_attn.cute, flash_attn_interface, xformers",
    ):
        default_resolver()
    monkeypatch.setenv("RINGDILATED_PACKAGES", "flash_attn, xformers")
    assert default_resolver().env.packages == {"flash_attn", "xformers"}
    monkeypatch.setenv("RINGDILATED_PACKAGES", "")
    default_resolver.cache_clear()
    assert default_resolver().env.packages == frozenset()


def test_a_misspelt_package_is_reported_even_when_an_unrelated_plugin_failed(
    monkeypatch: pytest.MonkeyPatch, fresh_default_resolver: None
) -> None:
    """A review found the check off whenever any plugin had failed to load: a misspelt
    RINGDILATED_PACKAGES name then silently counted a needed package as missing. It is
    reported, naming the failed plugins as possibly requiring the name; as a PluginWarning, not
    an error (a re-review: the name may be the broken plugin's own package, and raising would
    stop every other backend); calls still work; without a failed plugin it raises."""
    from ringdilated import registry as registry_module

    with pytest.warns(PluginWarning):
        broken = _registry(FakeEntryPoint("broken", _raise_import))
    monkeypatch.setattr(registry_module, "load_registry", lambda: broken)
    monkeypatch.setenv("RINGDILATED_PACKAGES", "flash-attn")
    with pytest.warns(
        PluginWarning,
        match=r"^RINGDILATED_PACKAGES='flash-attn' names 'flash-attn', not a package a kernel "
        r"requires; accepted: flash_attn, flash_attn.cute, flash_attn_interface, xformers .*; "
        r"plugins that failed to load, whose "
        r"kernels' packages are unknown, may require it: 'broken' ",
    ):
        resolver = registry_module.default_resolver()
    assert resolver.env.packages == {"flash-attn"}
    q = torch.randn(1, 8, 2, 4)
    out = ringdilated.dilated_attention(q, q, q, [8], [1])  # on the cached default resolver
    assert out.shape == q.shape
    registry_module.default_resolver.cache_clear()
    monkeypatch.setenv("RINGDILATED_PACKAGES", "flash_attn")
    assert registry_module.default_resolver().env.packages == {"flash_attn"}
    registry_module.default_resolver.cache_clear()
    monkeypatch.setattr(registry_module, "load_registry", lambda: _registry())
    monkeypatch.setenv("RINGDILATED_PACKAGES", "flash-attn")
    with pytest.raises(ValueError, match=r"^RINGDILATED_PACKAGES='flash-attn' names 'flash-attn'"):
        registry_module.default_resolver()


def test_a_forced_kernel_from_the_environment_is_stripped_of_spaces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every other variable is stripped of surrounding spaces; RINGDILATED_KERNEL=' sdpa' used to
    raise "unknown kernel ' sdpa'"."""
    from ringdilated import Request
    from ringdilated.registry import default_resolver

    monkeypatch.setenv("RINGDILATED_KERNEL", " reference ")
    plan = default_resolver().resolve(Request())
    assert plan.kernel_name == "reference"
    assert plan.forced_by == "RINGDILATED_KERNEL=reference"
    monkeypatch.setenv("RINGDILATED_KERNEL", "  ")  # only spaces: unset, "auto" stays "auto"
    assert default_resolver().resolve(Request()).forced_by is None


def test_a_package_of_a_blocked_builtin_kernel_is_still_a_known_package(
    monkeypatch: pytest.MonkeyPatch, fresh_default_resolver: None
) -> None:
    """A review found RINGDILATED_PACKAGES=flash_attn refused once the flash plugin was blocked:
    naming a package that a blocked (or failed) plugin's kernel needs must not break calls."""
    from ringdilated.registry import default_resolver

    monkeypatch.setenv("RINGDILATED_BLOCK_PLUGINS", "flash")
    monkeypatch.setenv("RINGDILATED_PACKAGES", "flash_attn")
    resolver = default_resolver()
    assert resolver.env.packages == {"flash_attn"}
    assert "flash" not in resolver.specs


def test_an_unknown_forced_kernel_names_the_variable_and_the_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ringdilated import Request
    from ringdilated.registry import default_resolver

    monkeypatch.setenv("RINGDILATED_KERNEL", "sdap")
    with pytest.raises(
        ValueError, match=r"unknown kernel 'sdap' \(RINGDILATED_KERNEL=sdap\); known kernels: "
    ):
        default_resolver().resolve(Request())


# Issue 21, item 10: the pytest plugin tests the package under test, and fails (never skips)
# when that package's plugin is broken. Each case is a plugin author's package in a temporary
# directory: its pyproject.toml, its tests, and its distribution's metadata on PYTHONPATH (as
# pip would install it), run by a pytest subprocess like the author's CI.

GOOD_PLUGIN = """
import attrs
from ringdilated.backends.reference import REFERENCE_SPEC
from ringdilated.plugins import hookimpl

SPEC = attrs.evolve(REFERENCE_SPEC, name="goodk", priority=-100)


@hookimpl
def ringdilated_kernels():
    return [SPEC]
"""

AUTHOR_TESTS = """
def test_kernel_conforms(ringdilated_kernel):
    assert isinstance(ringdilated_kernel, str)


def test_communicator_conforms(ringdilated_communicator):
    assert isinstance(ringdilated_communicator, str)
"""


def _package(
    root: pathlib.Path, name: str, entry_points: dict[str, str] | None, ini: str = ""
) -> pathlib.Path:
    """A plugin author's checkout under ``root/name`` (installed when ``entry_points`` is not
    ``None``: its metadata goes to ``root/site``); returns its tests folder."""
    checkout = root / name
    (checkout / "tests").mkdir(parents=True)
    (checkout / "pyproject.toml").write_text(
        f'[project]\nname = "{name}"\nversion = "0.1"\n'
        + (f"\n[tool.pytest.ini_options]\n{ini}\n" if ini else "")
    )
    module = name.replace("-", "_")  # one basename per package: no rootdir-wide clash
    (checkout / "tests" / f"test_{module}_conforms.py").write_text(AUTHOR_TESTS)
    if entry_points is not None:
        info = root / "site" / f"{module}-0.1.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
        lines = "".join(f"{ep} = {target}\n" for ep, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[ringdilated]\n{lines}")
    return checkout / "tests"


def _run_author_tests(root: pathlib.Path, *paths: pathlib.Path) -> dict[str, tuple[str, str]]:
    """Run pytest on ``paths``: ``{test id: (outcome, message)}`` from its JUnit report."""
    (root / "site").mkdir(exist_ok=True)
    (root / "site" / "good_pkg_plugin.py").write_text(GOOD_PLUGIN)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RINGDILATED_")}
    env["PYTHONPATH"] = str(root / "site")
    report = root / "report.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={report}"]
        + [str(p) for p in paths],
        cwd=paths[0].parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        found = [c for c in case if c.tag in ("failure", "error", "skipped")]
        outcome = found[0].tag if found else "passed"
        message = found[0].get("message", "") if found else ""
        outcomes[case.get("name", "")] = (outcome, message)
    return outcomes


def test_the_pytest_plugin_fails_a_package_whose_plugin_cannot_import(
    tmp_path: pathlib.Path,
) -> None:
    """A broken import used to make the author's conformance tests skip (an empty parameter
    set): their CI stayed green. Now each fails, quoting the import error."""
    tests = _package(tmp_path, "broken-pkg", {"broken": "missing_module_of_broken_pkg"})
    outcomes = _run_author_tests(tmp_path, tests)
    assert set(outcomes) == {
        "test_kernel_conforms[broken-plugin-failed]",
        "test_communicator_conforms[broken-plugin-failed]",
    }, outcomes
    for outcome, message in outcomes.values():
        assert outcome == "error", outcomes
        assert "plugin 'broken' of the package under test, 'broken-pkg', failed" in message
        assert "ModuleNotFoundError: No module named 'missing_module_of_broken_pkg'" in message


def test_the_pytest_plugin_tests_only_the_package_under_test(tmp_path: pathlib.Path) -> None:
    """Every installed plugin's backends used to be tested (here the example plugin's
    ``chunked`` and the broken package's failure too); now only the package's own."""
    _package(tmp_path, "broken-pkg", {"broken": "missing_module_of_broken_pkg"})
    tests = _package(tmp_path, "good-pkg", {"good": "good_pkg_plugin"})
    outcomes = _run_author_tests(tmp_path, tests)
    assert outcomes == {
        "test_kernel_conforms[goodk]": ("passed", ""),
        "test_communicator_conforms[no-communicators]": (
            "skipped",
            "the package under test, 'good-pkg', offers no communicators",
        ),
    }


def test_the_pytest_plugin_fails_a_package_that_offers_no_backend_at_all(
    tmp_path: pathlib.Path,
) -> None:
    """A plugin that imports but offers nothing (a hook returning ``[]``, a misspelt hook name,
    no hooks at all) used to skip both conformance tests: the author's CI was green with nothing
    run. Now both fail, naming the package; one kind is skipped only when the other is offered
    (test_the_pytest_plugin_tests_only_the_package_under_test)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "empty_pkg_plugin.py").write_text(
        "from ringdilated.plugins import hookimpl\n\n\n"
        "@hookimpl\ndef ringdilated_kernels():\n    return []\n"
    )
    (site / "misnamed_pkg_plugin.py").write_text(
        "from ringdilated.plugins import hookimpl\n\n\n"
        "@hookimpl\ndef ringdilated_kernel():\n    return []\n"
    )
    (site / "nohooks_pkg_plugin.py").write_text("X = 1\n")
    packages = {
        name: _package(tmp_path, name, {name.split("-")[0]: name.replace("-", "_") + "_plugin"})
        for name in ("empty-pkg", "misnamed-pkg", "nohooks-pkg")
    }
    outcomes = _run_author_tests(tmp_path, *packages.values())
    expected = {
        f"test_{test}_conforms[{name}-offers-nothing]"
        for name in packages
        for test in ("kernel", "communicator")
    }
    assert set(outcomes) == expected, outcomes
    for test_id, (outcome, message) in outcomes.items():
        name = test_id.split("[")[1].removesuffix("-offers-nothing]")
        assert outcome == "error", outcomes
        assert (
            f"the package under test, {name!r}, offers no kernels and no communicators" in message
        )


def test_the_pytest_plugin_fails_when_the_package_is_not_installed_or_has_no_plugin(
    tmp_path: pathlib.Path,
) -> None:
    missing = _package(tmp_path, "not-installed-pkg", None)
    no_entry_point = _package(tmp_path, "no-entry-point-pkg", {})
    outcomes = _run_author_tests(tmp_path, missing, no_entry_point)
    assert {name: outcome for name, (outcome, _) in outcomes.items()} == {
        "test_kernel_conforms[not-installed-pkg-not-installed]": "error",
        "test_communicator_conforms[not-installed-pkg-not-installed]": "error",
        "test_kernel_conforms[no-entry-point-pkg-no-entry-point]": "error",
        "test_communicator_conforms[no-entry-point-pkg-no-entry-point]": "error",
    }
    messages = " ".join(message for _, message in outcomes.values())
    assert "'not-installed-pkg' (from " in messages and "is not installed" in messages
    assert "'no-entry-point-pkg' (from " in messages and "declares no entry point" in messages


def test_the_pytest_plugin_fails_a_named_backend_that_is_not_loaded(
    tmp_path: pathlib.Path,
) -> None:
    """With the ini option naming the backend (as the example plugin does), a broken import
    used to reach the test as a plain name; now the test fails quoting the import error."""
    tests = _package(
        tmp_path,
        "broken-pkg",
        {"broken": "missing_module_of_broken_pkg"},
        ini='ringdilated_kernels = ["broken"]\nringdilated_communicators = ["ringpass"]',
    )
    outcomes = _run_author_tests(tmp_path, tests)
    assert outcomes["test_communicator_conforms[ringpass]"] == ("passed", "")
    outcome, message = outcomes["test_kernel_conforms[broken]"]
    assert outcome == "error"
    assert "kernel 'broken' (ini option ringdilated_kernels) is not loaded" in message
    assert "No module named 'missing_module_of_broken_pkg'" in message
