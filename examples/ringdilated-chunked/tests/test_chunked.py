"""The example plugin's own tests: the ringdilated conformance kit, through its pytest plugin."""

from __future__ import annotations

import pytest
import torch
from ringdilated_chunked import ChunkedKernel

import ringdilated
from ringdilated.testing import assert_within_tolerance, check_kernel, dense_attention, oracle


def test_chunked_kernel_passes_the_conformance_kit(ringdilated_kernel: str) -> None:
    """``ringdilated_kernel`` is parametrized by ringdilated's pytest plugin (pytest11)."""
    report = check_kernel(ringdilated_kernel, max_examples=25)
    assert "gradients" in report.passed and "causal" in report.passed


def test_small_chunks_conform() -> None:
    import attrs
    from ringdilated_chunked import CHUNKED_SPEC

    spec = attrs.evolve(CHUNKED_SPEC, factory=lambda: ChunkedKernel(chunk=3))
    check_kernel(spec, max_examples=25)


def test_forced_by_name_end_to_end() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 48, 4, 8, generator=g, requires_grad=True) for _ in range(3))
    out = ringdilated.dilated_attention(q, k, v, [16, 48], [1, 3], causal=True, kernel="chunked")
    expected = oracle(q, k, v, [16, 48], [1, 3], causal=True)
    baseline = dense_attention(q, k, v, [16, 48], [1, 3], causal=True)[0]
    assert_within_tolerance(out, expected, baseline, what="out")


def test_bad_chunk_is_refused() -> None:
    with pytest.raises(ValueError, match="chunk must be a positive number of keys, got 0"):
        ChunkedKernel(chunk=0)
