"""``torch.use_deterministic_algorithms`` reaches the request (issue 23): it refuses no kernel,
and a chosen kernel that declares no deterministic mode is named in ``explain()``, down to the
module's; a plan made before the switch flipped is not reused after."""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import pytest
import torch

import ringdilated
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.core import CAUSAL, FULL, Capabilities, KernelSpec, Request, Resolver
from ringdilated.functional import default_resolver
from ringdilated.testing import oracle

NOTE = "torch.are_deterministic_algorithms_enabled() is on, but {} declares no deterministic mode"


def _spec(name: str, deterministic: bool, priority: int = 0) -> KernelSpec:
    capabilities = attrs.evolve(REFERENCE_SPEC.capabilities, deterministic=deterministic)
    return KernelSpec(name, ReferenceKernel, capabilities, priority=priority)


@pytest.fixture
def deterministic_algorithms() -> Iterator[None]:
    """``torch.use_deterministic_algorithms(True)`` for the test, restored after (warn-only too)."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


def test_the_request_reads_torchs_switch_when_it_is_built() -> None:
    q, k = torch.randn(1, 8, 4, 8), torch.randn(1, 8, 2, 8)

    def request() -> Request:
        return Request.for_tensors(q, k, window=FULL, dropout=False, backward=False)

    assert not torch.are_deterministic_algorithms_enabled()
    assert request().deterministic is False
    torch.use_deterministic_algorithms(True)
    try:
        built = request()
    finally:
        torch.use_deterministic_algorithms(False)
    assert built.deterministic is True and built.gqa is True
    assert request().deterministic is False


def test_describe_lists_it_after_the_features() -> None:
    assert (
        Request(window=CAUSAL, deterministic=True)
        .describe()
        .endswith("needs: causal, backward, deterministic")
    )
    assert "deterministic" not in Request(window=CAUSAL).describe()


def test_a_kernel_without_a_deterministic_mode_ranks_after_those_with_one() -> None:
    """Under the switch, ranked after a lower-priority kernel that has one, and said so; when
    it is the only kernel that fits it is still chosen, with the note."""
    resolver = Resolver([_spec("fastnd", False, priority=10), _spec("slowdet", True)])
    passed_over = resolver.resolve(Request(head_dim=8, deterministic=True))
    assert passed_over.kernel_name == "slowdet"
    assert "not chosen fastnd: fits, priority 10, but no deterministic mode" in (
        passed_over.explain()
    )
    assert resolver.resolve(Request(head_dim=8)).kernel_name == "fastnd"  # switch off
    alone = Resolver([_spec("fastnd", False, priority=10)])
    chosen = alone.resolve(Request(head_dim=8, deterministic=True))
    assert chosen.kernel_name == "fastnd" and chosen.deterministic is False
    assert "  note: " + NOTE.format("fastnd") in chosen.explain()
    # Switch off: the same kernel, no note.
    assert NOTE.format("fastnd") not in resolver.resolve(Request(head_dim=8)).explain()
    # A kernel that declares one: no note.
    forced = resolver.resolve(Request(head_dim=8, deterministic=True), "slowdet")
    assert forced.deterministic is True and "declares no deterministic mode" not in forced.explain()
    # An instance declares nothing and counts as having one.
    instance = resolver.resolve(Request(head_dim=8, deterministic=True), ReferenceKernel())
    assert "declares no deterministic mode" not in instance.explain()


def test_the_module_explains_it_and_replans_when_the_switch_flips(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The process-wide layout keeps plans by call signature: the switch is part of it."""
    resolver = default_resolver()
    monkeypatch.setitem(resolver.specs, "nodet", _spec("nodet", False))
    monkeypatch.setitem(resolver._kernels, "nodet", ReferenceKernel())
    attn = ringdilated.DilatedAttention([8], [2], causal=True, kernel="nodet")
    q = torch.randn(1, 16, 2, 8, dtype=torch.float64)
    attn(q, q, q)
    assert NOTE.format("nodet") not in attn.explain()
    torch.use_deterministic_algorithms(True)
    try:
        out = attn(q, q, q)
        on = attn.explain()
    finally:
        torch.use_deterministic_algorithms(False)
    assert "needs: causal, deterministic" in on and "  note: " + NOTE.format("nodet") in on
    assert torch.allclose(out, oracle(q, q, q, [8], [2], causal=True), atol=1e-12, rtol=0)
    attn(q, q, q)
    assert NOTE.format("nodet") not in attn.explain()


def test_a_functional_call_under_the_switch_runs_and_carries_it(
    deterministic_algorithms: None,
) -> None:
    from ringdilated.functional import attend

    resolver = Resolver([_spec("nd", False)])
    q = torch.randn(1, 16, 2, 8, dtype=torch.float64)
    out, _, plan = attend(
        ringdilated.DilationPattern([8], [2]), q, q, q, causal=False, scale=None,
        dropout_p=0.0, kernel="auto", resolver=resolver,
    )  # fmt: skip
    assert plan is not None and plan.kernel.request.deterministic is True
    assert NOTE.format("nd") in plan.kernel.explain()
    assert torch.allclose(out, oracle(q, q, q, [8], [2]), atol=1e-12, rtol=0)


def test_capabilities_default_to_no_deterministic_mode() -> None:
    assert Capabilities(targets=REFERENCE_SPEC.capabilities.targets).deterministic is False


def test_the_header_says_when_determinism_passed_a_kernel_over() -> None:
    resolver = Resolver([_spec("fastnd", False, priority=50), _spec("slowdet", True)])
    text = resolver.resolve(Request(head_dim=8, deterministic=True)).explain()
    assert "kernel: slowdet (priority 0, highest priority with a deterministic mode that fits)" in (
        text
    )
    plain = resolver.resolve(Request(head_dim=8)).explain()
    assert "kernel: fastnd (priority 50, highest priority that fits)" in plain


def test_warn_only_mode_counts_as_off() -> None:
    """torch's own attention backwards keep their nondeterministic path when it only warns."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    q = torch.randn(1, 8, 2, 8)
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        request = Request.for_tensors(q, q, window=FULL, dropout=False, backward=True)
        assert not ringdilated.core.deterministic_algorithms() and not request.deterministic
        torch.use_deterministic_algorithms(True)
        assert ringdilated.core.deterministic_algorithms()
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


class BrokenCapabilities:
    """A plugin's capabilities object whose every attribute read fails."""

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(f"broken plugin: {name}")


def test_a_broken_plugin_spec_is_contained_under_the_switch() -> None:
    broken = attrs.evolve(_spec("broken", False, priority=10))
    object.__setattr__(broken, "capabilities", BrokenCapabilities())
    resolver = Resolver([broken, _spec("slowdet", True)])
    for deterministic in (False, True):
        chosen = resolver.resolve(Request(head_dim=8, deterministic=deterministic))
        assert chosen.kernel_name == "slowdet", chosen.explain()
        assert "rejected broken" in chosen.explain()
