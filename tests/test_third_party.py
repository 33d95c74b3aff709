"""The example third-party package (examples/ringdilated-chunked), installed by the test run
exactly as a user would install a plugin, is discovered, resolvable, forceable and conformant."""

from __future__ import annotations

import importlib.metadata
import pathlib

import pytest
import torch

import ringdilated
from ringdilated import Request
from ringdilated.functional import default_resolver
from ringdilated.plugins import load_registry
from ringdilated.testing import check_kernel


@pytest.fixture(scope="module", autouse=True)
def installed() -> None:
    try:
        importlib.metadata.distribution("ringdilated-chunked")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(
            "the example plugin is not installed; the README's test line installs it: "
            "pip install ./examples/ringdilated-chunked"
        )


def test_discovered_through_the_entry_point_only() -> None:
    registry = load_registry()
    assert (
        registry.origins["chunked"] == "chunked (entry point 'chunked' (ringdilated-chunked 0.1.0))"
    )
    (info,) = [p for p in registry.plugins if p.name == "chunked"]
    assert (info.source, info.distribution, info.kernels) == (
        "entry point",
        "ringdilated-chunked",
        ("chunked",),
    )
    source = pathlib.Path(ringdilated.plugins.manager.__file__).read_text()
    assert "ringdilated_chunked" not in source


def test_resolvable_and_explained() -> None:
    plan = default_resolver().resolve(Request("cpu", torch.float32, 16))
    assert plan.kernel_name == "sdpa"  # its priority is below the built-ins
    assert "not chosen chunked: fits, priority -5" in plan.explain()


def test_forceable_by_name_and_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(1, 32, 2, 8, dtype=torch.float64)
    forced = ringdilated.dilated_attention(q, q, q, [8, 32], [1, 2], kernel="chunked")
    monkeypatch.setenv("RINGDILATED_KERNEL", "chunked")
    by_env = ringdilated.dilated_attention(q, q, q, [8, 32], [1, 2])
    expected = ringdilated.testing.oracle(q, q, q, [8, 32], [1, 2])
    assert ringdilated.testing.max_error(forced, expected) < 1e-12
    assert torch.equal(forced, by_env)


def test_passes_the_kit() -> None:
    report = check_kernel("chunked", max_examples=15)
    spec = ringdilated.default_resolver().specs["chunked"]
    assert report.passed == ringdilated.testing.applicable_checks(spec)
    # it declares neither dropout nor softcap
    assert report.not_applicable == ("dropout", "softcap", "softcap-gradients", "softcap-dropout")


def test_blocked_and_allow_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringdilated.plugins import build_registry

    assert "chunked" not in build_registry(blocked=["chunked"]).kernels
    assert "chunked" not in build_registry(allowed=["something-else"]).kernels
    assert "chunked" in build_registry(allowed=["chunked"]).kernels
