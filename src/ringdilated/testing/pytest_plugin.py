"""ringdilated's pytest plugin (registered through the ``pytest11`` entry point).

It parametrizes two fixtures, so a plugin author's whole conformance suite is::

    from ringdilated.testing import check_communicator, check_kernel

    def test_kernel_conforms(ringdilated_kernel):
        check_kernel(ringdilated_kernel)

    def test_communicator_conforms(ringdilated_communicator):
        check_communicator(ringdilated_communicator)

``ringdilated_kernel`` runs over the ini option ``ringdilated_kernels`` (a list of names) or, if
that is empty, over every kernel that came from an entry-point plugin (the built-ins are
ringdilated's own to test); ``ringdilated_communicator`` likewise with
``ringdilated_communicators``. Nothing here imports torch until a test asks for a fixture.
"""

from __future__ import annotations

import pytest

__all__ = ["pytest_addoption", "pytest_generate_tests"]

_FIXTURES = {
    "ringdilated_kernel": ("ringdilated_kernels", "kernels"),
    "ringdilated_communicator": ("ringdilated_communicators", "communicators"),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    for fixture, (option, kind) in _FIXTURES.items():
        parser.addini(
            option,
            f"{kind} the {fixture} fixture runs over (default: every {kind[:-1]} that an "
            "entry-point plugin provides)",
            type="args",
            default=[],
        )


def _third_party(kind: str) -> list[str]:
    from ringdilated.plugins import load_registry

    registry = load_registry()
    origins = registry.origins if kind == "kernels" else registry.communicator_origins
    return sorted(name for name, origin in origins.items() if not origin.endswith("(built-in)"))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    for fixture, (option, kind) in _FIXTURES.items():
        if fixture in metafunc.fixturenames:
            names = list(metafunc.config.getini(option)) or _third_party(kind)
            metafunc.parametrize(fixture, names, ids=names)
