"""ringdilated's pytest plugin (registered through the ``pytest11`` entry point).

It parametrizes two fixtures, so a plugin author's whole conformance suite is::

    from ringdilated.testing import check_communicator, check_kernel

    def test_kernel_conforms(ringdilated_kernel):
        check_kernel(ringdilated_kernel)

    def test_communicator_conforms(ringdilated_communicator):
        check_communicator(ringdilated_communicator)

Which backends (each fixture's value is a backend name):

- the names in the ini option ``ringdilated_kernels`` (``ringdilated_communicators`` for the
  communicator fixture), when it is set;
- else every backend offered by the ``ringdilated`` entry points of the **package under test**,
  and by no other installed plugin: the distribution named by the ini option
  ``ringdilated_distribution``, else the ``[project] name`` of the nearest ``pyproject.toml``
  above the test file (so a plugin's own tests, run from anywhere, test that plugin).

A test never skips because something is broken: it fails at setup, with the reason (the
registry's failures quoted), for a named backend that is not loaded, for a plugin of the package
under test that failed or was not loaded, and for a package under test that cannot be found, is
not installed, declares no ``ringdilated`` entry point or offers no backend of either kind. Only
a package that offers backends of the other kind skips the fixture's kind (a kernel plugin's
communicator test), saying so. Nothing here imports torch until a test asks for a fixture.
"""

from __future__ import annotations

import functools
import importlib.metadata
import pathlib
import re
import sys
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from _pytest.mark.structures import ParameterSet

    from ringdilated.plugins import PluginRegistry

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself depends on tomli before 3.11
    import tomli as tomllib

__all__ = [
    "pytest_addoption",
    "pytest_generate_tests",
    "ringdilated_communicator",
    "ringdilated_kernel",
]

_FIXTURES = {
    "ringdilated_kernel": ("ringdilated_kernels", "kernels"),
    "ringdilated_communicator": ("ringdilated_communicators", "communicators"),
}
_DISTRIBUTION_OPTION = "ringdilated_distribution"


class Unusable:
    """A fixture value that fails its test at setup with :attr:`reason` (never a skip)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"Unusable({self.reason!r})"


def pytest_addoption(parser: pytest.Parser) -> None:
    for fixture, (option, kind) in _FIXTURES.items():
        parser.addini(
            option,
            f"{kind} the {fixture} fixture runs over (default: every {kind[:-1]} that the "
            f"package under test's entry points provide; see {_DISTRIBUTION_OPTION})",
            type="args",
            default=[],
        )
    parser.addini(
        _DISTRIBUTION_OPTION,
        "the distribution under test, whose 'ringdilated' entry points the ringdilated_kernel "
        "and ringdilated_communicator fixtures test (default: [project] name in the nearest "
        "pyproject.toml above the test file)",
        type="string",
        default="",
    )


def _value(request: pytest.FixtureRequest) -> str:
    param: Any = getattr(request, "param", None)
    if isinstance(param, Unusable):
        pytest.fail(param.reason, pytrace=False)
    if not isinstance(param, str):
        pytest.fail(
            f"{request.fixturename} was not parametrized by ringdilated's pytest plugin",
            pytrace=False,
        )
    return param


@pytest.fixture
def ringdilated_kernel(request: pytest.FixtureRequest) -> str:
    """The name of one kernel under test (see the module docstring for which)."""
    return _value(request)


@pytest.fixture
def ringdilated_communicator(request: pytest.FixtureRequest) -> str:
    """The name of one communicator under test (see the module docstring for which)."""
    return _value(request)


def _normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them."""
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.lru_cache(maxsize=64)
def _project_above(directory: pathlib.Path) -> tuple[str, pathlib.Path] | None:
    """``([project] name, its pyproject.toml)`` of the nearest ``pyproject.toml`` at or above
    ``directory`` that has one; ``None`` if none does."""
    for folder in (directory, *directory.parents):
        candidate = folder / "pyproject.toml"
        if not candidate.is_file():
            continue
        with candidate.open("rb") as f:
            project = tomllib.load(f).get("project", {})
        name = project.get("name") if isinstance(project, dict) else None
        if isinstance(name, str) and name:
            return name, candidate
    return None


def _package_under_test(metafunc: pytest.Metafunc) -> tuple[str, str] | Unusable:
    """The distribution under test and where that was read, or why none was found."""
    configured = str(metafunc.config.getini(_DISTRIBUTION_OPTION) or "").strip()
    if configured:
        return configured, f"ini option {_DISTRIBUTION_OPTION}"
    path = pathlib.Path(metafunc.definition.path).resolve()
    found = _project_above(path.parent)
    if found is None:
        return Unusable(
            f"ringdilated's pytest plugin cannot tell which package is under test: no "
            f"pyproject.toml with a [project] name above {path}; set the ini option "
            f"{_DISTRIBUTION_OPTION} (or name the backends in ringdilated_kernels / "
            f"ringdilated_communicators)"
        )
    name, pyproject = found
    return name, str(pyproject)


def _package_params(
    registry: PluginRegistry, kind: str, distribution: str, where: str
) -> list[ParameterSet]:
    """One parameter per backend of ``kind`` the distribution's plugins offer, and one failing
    parameter per plugin of it that failed or did not load."""
    try:
        dist = importlib.metadata.distribution(distribution)
    except importlib.metadata.PackageNotFoundError:
        reason = (
            f"the package under test, {distribution!r} (from {where}), is not installed: install "
            f"it (pip install -e .) so its 'ringdilated' entry points can be tested"
        )
        return [pytest.param(Unusable(reason), id=f"{distribution}-not-installed")]
    entry_points = sorted(ep.name for ep in dist.entry_points if ep.group == "ringdilated")
    if not entry_points:
        reason = (
            f"the package under test, {distribution!r} (from {where}), declares no entry point "
            f"in the 'ringdilated' group ([project.entry-points.ringdilated] in pyproject.toml)"
        )
        return [pytest.param(Unusable(reason), id=f"{distribution}-no-entry-point")]
    package = _normalize(dist.metadata["Name"] or "")
    ours = [p for p in registry.plugins if _normalize(p.distribution or "") == package]
    params: list[ParameterSet] = []
    offered_any = False
    for name in entry_points:
        failures = registry.failures_of(name)
        if failures:
            reason = (
                f"plugin {name!r} of the package under test, {distribution!r}, failed: "
                + "; ".join(failures)
            )
            params.append(pytest.param(Unusable(reason), id=f"{name}-plugin-failed"))
        infos = [p for p in ours if p.name == name and p.source == "entry point"]
        if not infos and not failures:
            reason = (
                f"plugin {name!r} of the package under test, {distribution!r}, was not loaded: "
                f"entry-point autoloading is off (RINGDILATED_DISABLE_PLUGIN_AUTOLOAD), or "
                f"RINGDILATED_BLOCK_PLUGINS / RINGDILATED_ALLOW_PLUGINS leaves it out"
            )
            params.append(pytest.param(Unusable(reason), id=f"{name}-not-loaded"))
        for info in infos:
            backends = info.kernels if kind == "kernels" else info.communicators
            params.extend(pytest.param(b, id=b) for b in backends)
            offered_any = offered_any or bool(info.kernels or info.communicators)
    if params:
        return params
    if not offered_any:
        reason = (
            f"the package under test, {distribution!r}, offers no kernels and no communicators: "
            f"its plugin(s) {', '.join(repr(n) for n in entry_points)} loaded, but no "
            f"ringdilated_kernels() or ringdilated_communicators() hook returned a backend (a "
            f"hook returning [], a misspelt hook name, a module without @hookimpl functions)"
        )
        return [pytest.param(Unusable(reason), id=f"{distribution}-offers-nothing")]
    reason = f"the package under test, {distribution!r}, offers no {kind}"
    return [pytest.param("", id=f"no-{kind}", marks=pytest.mark.skip(reason=reason))]


def _params(metafunc: pytest.Metafunc, option: str, kind: str) -> list[ParameterSet]:
    from ringdilated.plugins import load_registry

    registry = load_registry()
    names = [str(n) for n in metafunc.config.getini(option)]
    if names:
        offered = sorted(registry.kernels if kind == "kernels" else registry.communicators)
        not_loaded = (
            f"(ini option {option}) is not loaded; loaded {kind}: {', '.join(offered) or 'none'}; "
            f"plugin failures: {'; '.join(registry.failures) or 'none'}"
        )
        return [
            pytest.param(n if n in offered else Unusable(f"{kind[:-1]} {n!r} {not_loaded}"), id=n)
            for n in names
        ]
    package = _package_under_test(metafunc)
    if isinstance(package, Unusable):
        return [pytest.param(package, id="no-package-under-test")]
    return _package_params(registry, kind, *package)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for fixture, (option, kind) in _FIXTURES.items():
        if fixture in metafunc.fixturenames:
            metafunc.parametrize(fixture, _params(metafunc, option, kind), indirect=True)
