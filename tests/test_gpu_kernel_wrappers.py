"""The flash, xformers and flex kernel wrappers, run on CPU against stand-ins with the
packages' documented semantics (tests/standins), through the full conformance kit.

What this proves: layouts, grouped-query heads, causal offsets as bottom-right pieces, lse
conventions and the backward rule of each wrapper. What it cannot: the real CUDA kernels (their
tests are in tests/test_gpu.py, marked ``gpu``).
"""

from __future__ import annotations

import attrs
import pytest
import torch

import ringdilated
from ringdilated.backends.flash import FLASH_SPEC
from ringdilated.backends.flex import FLEX_SPEC, FlexKernel
from ringdilated.backends.xformers import XFORMERS_SPEC
from ringdilated.core import Environment, KernelSpec, Request, Resolver, Target
from ringdilated.core.causal import bottom_right_pieces
from ringdilated.testing import check_kernel
from ringdilated.testing.conformance import CHECKS
from tests.standins import install_flash_attn, install_xformers, math_flex_attention

CPU_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32})


def on_cpu(spec: KernelSpec) -> KernelSpec:
    """``spec`` with its CUDA targets replaced by a CPU one (the stand-ins run anywhere)."""
    target = Target("cpu", CPU_FLOATS, head_dim_multiple=8)
    return attrs.evolve(
        spec, capabilities=attrs.evolve(spec.capabilities, targets=(target,), requires=())
    )


def test_bottom_right_pieces_reproduce_every_offset() -> None:
    for q_len in range(6):
        for k_len in range(6):
            for offset in [None, *range(-7, 8)]:
                _check_pieces(q_len, k_len, offset)


def _check_pieces(q_len: int, k_len: int, offset: int | None) -> None:
    visible = torch.zeros(q_len, k_len, dtype=torch.bool)
    for p in bottom_right_pieces(q_len, k_len, offset):
        rows = p.row_stop - p.row_start
        assert p.row_start < p.row_stop and 0 < p.keys <= k_len
        for i in range(rows):
            limit = i + (p.keys - rows) if p.causal else p.keys - 1
            assert limit >= 0, "a piece never contains an empty row"
            visible[p.row_start + i, : min(limit, p.keys - 1) + 1] = True
    rows = torch.arange(q_len).unsqueeze(1)
    cols = torch.arange(k_len).unsqueeze(0)
    expected = cols <= rows + (k_len if offset is None else offset)
    assert torch.equal(visible, expected)


def test_flash_wrapper_conforms(monkeypatch: pytest.MonkeyPatch) -> None:
    install_flash_attn(monkeypatch)
    report = check_kernel(on_cpu(FLASH_SPEC), max_examples=25)
    assert report.passed == CHECKS


def test_xformers_wrapper_conforms(monkeypatch: pytest.MonkeyPatch) -> None:
    install_xformers(monkeypatch)
    report = check_kernel(on_cpu(XFORMERS_SPEC), max_examples=25)
    assert report.passed == CHECKS


def test_flex_backward_rule_conforms() -> None:
    spec = attrs.evolve(
        on_cpu(FLEX_SPEC), factory=lambda: FlexKernel(attention=math_flex_attention)
    )
    report = check_kernel(spec, max_examples=25)
    assert report.passed == CHECKS


def test_flex_on_cpu_is_forward_only_and_conforms() -> None:
    report = check_kernel("flex", max_examples=15)
    assert report.passed == ("capabilities", "forward", "causal", "empty-rows", "no-mutation")
    assert report.not_applicable == ("gradients", "split-merge")
    reasons = FLEX_SPEC.reasons(Request(head_dim=16, backward=True), Environment())
    assert reasons == (
        "no backward (gradients) on cpu (eager FlexAttention: forward only, unfused)",
    )


def test_forced_flex_serves_inference_on_cpu() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 40, 4, 16, generator=g) for _ in range(3))
    with torch.no_grad():
        out = ringdilated.dilated_attention(q, k, v, [8, 16], [1, 2], causal=True, kernel="flex")
    expected = ringdilated.testing.oracle(q, k, v, [8, 16], [1, 2], causal=True)
    assert ringdilated.testing.max_error(out, expected) < 1e-5
    with pytest.raises(ringdilated.ResolutionError, match="no backward"):
        ringdilated.dilated_attention(
            q.requires_grad_(), k, v, [8, 16], [1, 2], causal=True, kernel="flex"
        )


def test_flash_older_than_2_6_falls_back_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    install_flash_attn(monkeypatch, version="2.5.9")
    env = Environment(frozenset({"flash_attn"}), compute_capability=(8, 0))
    resolver = Resolver([FLASH_SPEC, ringdilated.backends.sdpa.SDPA_SPEC], env=env)
    request = Request("cuda", torch.bfloat16, 64, (8, 0))
    plan = resolver.resolve(request)
    assert plan.kernel_name == "sdpa"
    assert "flash-attn 2.5.9 is older than the 2.6 this kernel needs" in plan.explain()
