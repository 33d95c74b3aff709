"""``torch.use_deterministic_algorithms`` reaches the request (issue 23): it refuses no kernel,
and a chosen kernel that declares no deterministic mode is named in ``explain()``, down to the
module's; a plan made before the switch flipped is not reused after. The plan's reading reaches
every kernel call as ``BlockOptions.deterministic``, which the kernels read instead of the
switch: a backward runs as its call was planned."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
import pytest
import torch

import ringdilated
from ringdilated.backends.flash import FLASH_SPEC
from ringdilated.backends.flash3 import FLASH3_SPEC, Flash3Kernel
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.core import (
    CAUSAL,
    FULL,
    BlockOptions,
    Capabilities,
    KernelChoice,
    KernelSpec,
    KeyWindow,
    Request,
    Resolver,
)
from ringdilated.functional import default_resolver
from ringdilated.testing import oracle
from tests.standins import flash_attn3 as fa3
from tests.standins import install_flash_attn
from tests.standins.flash_attn import BACKWARD_CALLS
from tests.test_gpu_kernel_wrappers import on_cpu

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


# -- the plan's reading reaches every kernel call: BlockOptions.deterministic ----------------------


def test_block_options_carry_it_keyword_only_and_checked() -> None:
    plain = BlockOptions(0.5)
    assert plain.deterministic is False
    asked = BlockOptions(0.5, KeyWindow(None, 0), 0.1, 7, deterministic=True)
    assert asked.deterministic is True and asked != attrs.evolve(asked, deterministic=False)
    assert attrs.evolve(asked, dropout_seed=8).deterministic is True, "evolve keeps it"
    with pytest.raises(TypeError):
        BlockOptions(0.5, FULL, 0.0, 0, None, True)  # type: ignore[misc]
    with pytest.raises(TypeError, match=r"BlockOptions.deterministic must be a bool, got 1"):
        BlockOptions(0.5, deterministic=1)  # type: ignore[arg-type]


@contextlib.contextmanager
def switch(on: bool) -> Iterator[None]:
    """torch's switch set to ``on`` (strict) inside the block, its setting restored after."""
    before = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before, warn_only=warn_only)


SEEN: list[tuple[str, bool]] = []


class OptionsRecorder(ReferenceKernel):
    """The reference kernel, recording ``options.deterministic`` of every call."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        SEEN.append(("forward", options.deterministic))
        return super().forward(q, k, v, options)

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        SEEN.append(("backward", options.deterministic))
        return super().backward(dout, q, k, v, out, lse, options)


@pytest.mark.parametrize("on", [False, True])
def test_every_kernel_call_of_a_plan_gets_its_reading(on: bool) -> None:
    """Forward, backward and the lse gradient's backward (``return_lse``), every block."""
    from ringdilated.functional import attend

    resolver = Resolver([KernelSpec("rec", OptionsRecorder, REFERENCE_SPEC.capabilities)])
    q = torch.randn(1, 16, 2, 8, dtype=torch.float64, requires_grad=True)
    SEEN.clear()
    with switch(on):
        out, lse, plan = attend(
            ringdilated.DilationPattern([8, 16], [1, 2]), q, q, q, causal=True, scale=None,
            dropout_p=0.0, kernel="auto", resolver=resolver, return_lse=True,
        )  # fmt: skip
        (out.sum() + lse.sum()).backward()
    assert plan is not None and plan.kernel.request.deterministic is on
    kinds = [kind for kind, _ in SEEN]
    assert kinds.count("backward") > kinds.count("forward") >= 1, kinds  # the lse's too
    assert {flag for _, flag in SEEN} == {on}
    expected = oracle(q.detach(), q.detach(), q.detach(), [8, 16], [1, 2], causal=True)
    assert torch.allclose(out.detach(), expected, atol=1e-12, rtol=0)


def test_a_sharded_runs_crossing_calls_get_it_too() -> None:
    """The options a shard builds for its crossing pieces (one segment over both shards: its
    crossing 0, this rank's own piece and rank 0's), with and without dropout."""
    from ringdilated.core.plan.shards import shard_plan
    from ringdilated.core.run.local import pattern_run
    from ringdilated.core.run.sharded import ShardedRun

    pattern = ringdilated.DilationPattern([16], [1])
    plans = tuple(shard_plan(pattern, 16, 2, 2, rank, 2) for rank in range(2))
    q = torch.randn(1, 8, 2, 8)
    for on in (False, True):
        inner = pattern_run(
            ReferenceKernel(), pattern, q, q, window=CAUSAL, scale=None, dropout_p=0.1,
            blocks=plans[1].inner, complete=False, deterministic=on,
        )  # fmt: skip
        run = ShardedRun(inner, plans, 1, communicator=None, group=None, broadcast=False)  # type: ignore[arg-type]
        for src, seed in ((0, 0), (1, 0), (0, 5)):
            assert run.options(0, src, seed).deterministic is on


def _flash_call(
    resolver: Resolver, q: torch.Tensor, planned: bool, at_backward: bool
) -> KernelChoice:
    """A call planned with the switch at ``planned``, its backward run with it at
    ``at_backward``; the plan's kernel choice."""
    from ringdilated.functional import attend

    with switch(planned):
        out, _, plan = attend(
            ringdilated.DilationPattern([8], [1]), q, q, q, causal=True, scale=None,
            dropout_p=0.0, kernel="auto", resolver=resolver,
        )  # fmt: skip
    with switch(at_backward):
        out.float().sum().backward()
    assert plan is not None
    return plan.kernel


def test_a_backward_runs_as_its_call_was_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """flash's backward gets the plan's reading even when the switch flips between forward and
    backward, either way: the call's kernel was chosen for that reading (next test). (torch's own
    attention ops, behind sdpa, torch_flash and cudnn, read the switch when they run instead.)"""
    install_flash_attn(monkeypatch)
    resolver = Resolver([on_cpu(FLASH_SPEC)])
    q = torch.randn(1, 16, 2, 16).half().requires_grad_()
    for planned, at_backward in ((True, False), (False, True), (True, True), (False, False)):
        BACKWARD_CALLS.clear()
        chosen = _flash_call(resolver, q, planned, at_backward)
        assert chosen.kernel_name == "flash" and chosen.request.deterministic is planned
        flags = [call["deterministic"] for call in BACKWARD_CALLS]
        assert flags and set(flags) == {planned}, (planned, at_backward, flags)


def test_a_flipped_switch_replans_so_kernels_see_the_switch_of_their_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The plan key holds the switch: a call after a flip is planned anew (the plan before the
    flip is found again when the switch flips back), so the kernel sees the switch as it stood
    at each call."""
    install_flash_attn(monkeypatch)
    resolver = Resolver([on_cpu(FLASH_SPEC)])
    q = torch.randn(1, 16, 2, 16).half().requires_grad_()
    choices, flags = [], []
    for on in (False, True, False, True):
        BACKWARD_CALLS.clear()
        choices.append(_flash_call(resolver, q, on, on))
        flags.append({call["deterministic"] for call in BACKWARD_CALLS})
    assert flags == [{False}, {True}, {False}, {True}]
    assert choices[0] != choices[1] and choices[0] == choices[2] and choices[1] == choices[3]


def test_a_flip_after_planning_never_reaches_a_refused_deterministic_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FlashAttention 3.0.0 has no deterministic backward for head dim 256: the resolver
    declines it under the switch. A call planned without the switch chooses it; turned on
    before the backward, the switch does not reach the kernel (the stand-in raises, as
    ``mha_bwd`` does, when it is asked anyway)."""
    fa3.install_flash_attn3(monkeypatch, "3.0.0")
    resolver = Resolver([on_cpu(FLASH3_SPEC)])
    q = torch.randn(1, 16, 2, 256).half().requires_grad_()
    chosen = _flash_call(resolver, q, planned=False, at_backward=True)
    assert chosen.kernel_name == "flash3"
    flags = [call["deterministic"] for call in fa3.CALLS if call["op"] == "backward"]
    assert flags and not any(flags)
    kernel = Flash3Kernel()
    x = torch.randn(1, 2, 8, 256).half()
    out, lse = kernel.forward(x, x, x, BlockOptions(0.1))
    with pytest.raises(RuntimeError, match="Deterministic backward not supported for hdim 256"):
        kernel.backward(x, x, x, x, out, lse, BlockOptions(0.1, deterministic=True))
