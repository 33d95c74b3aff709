"""Every kernel against the float64 oracle: out, lse and gradients (docs/spec.md, sections 1, 2
and 4)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

import ringdilated
from ringdilated.testing import assert_within_tolerance, dense_attention, oracle
from tests.strategies import Case, cases, loss_of, upstream

KERNELS = ["sdpa", "reference"]


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The public lse is float32 (docs/spec.md, section 1), so float64 inputs get a float32 lse."""
    return torch.float32 if dtype == torch.float64 else dtype


@pytest.mark.parametrize("kernel", KERNELS)
@given(case=cases())
def test_forward_and_lse_match_oracle(kernel: str, case: Case) -> None:
    q, k, v = case.tensors()
    pattern = (case.segment_lengths, case.dilation_rates)
    out, lse = ringdilated.dilated_attention(
        q, k, v, *pattern, **case.kwargs(), kernel=kernel, return_lse=True
    )
    assert out.dtype == case.dtype and lse.dtype == torch.float32
    assert lse.shape == (case.batch, case.num_heads, case.seq_len)
    expected_out, expected_lse = oracle(q, k, v, *pattern, **case.kwargs(), return_lse=True)
    base_out, _ = dense_attention(q, k, v, *pattern, **case.kwargs())
    _, base_lse = dense_attention(q, k, v, *pattern, **case.kwargs(), dtype=_lse_dtype(case.dtype))
    assert_within_tolerance(out, expected_out, base_out, what="out")
    assert_within_tolerance(lse, expected_lse, base_lse, dtype=_lse_dtype(case.dtype), what="lse")


@pytest.mark.parametrize("kernel", KERNELS)
@given(case=cases())
def test_gradients_match_oracle(kernel: str, case: Case) -> None:
    q, k, v = case.tensors(requires_grad=True)
    pattern = (case.segment_lengths, case.dilation_rates)
    out, lse = ringdilated.dilated_attention(
        q, k, v, *pattern, **case.kwargs(), kernel=kernel, return_lse=True
    )
    dout, dlse = upstream(case.seed, out, lse)
    grads = torch.autograd.grad(loss_of(out, lse, dout, dlse), (q, k, v))

    expected = torch.autograd.grad(
        loss_of(*oracle(q, k, v, *pattern, **case.kwargs(), return_lse=True), dout, dlse), (q, k, v)
    )
    baseline = torch.autograd.grad(
        loss_of(*dense_attention(q, k, v, *pattern, **case.kwargs()), dout, dlse), (q, k, v)
    )
    for name, actual, exp, base in zip("qkv", grads, expected, baseline, strict=True):
        assert actual.dtype == case.dtype
        assert_within_tolerance(actual, exp, base, what=f"d{name}")


@pytest.mark.parametrize("kernel", KERNELS)
def test_partial_last_segment_and_short_sequence(kernel: str) -> None:
    """L below one segment and L not a multiple of it, with dilation: the rule holds inside."""
    torch.manual_seed(3)
    for seq_len in (5, 13, 29):
        q = torch.randn(1, seq_len, 4, 8, dtype=torch.float64, requires_grad=True)
        k = torch.randn(1, seq_len, 2, 8, dtype=torch.float64, requires_grad=True)
        v = torch.randn(1, seq_len, 2, 8, dtype=torch.float64, requires_grad=True)
        out = ringdilated.dilated_attention(q, k, v, [8, 16], [2, 4], kernel=kernel)
        expected = oracle(q, k, v, [8, 16], [2, 4])
        assert torch.allclose(out, expected, rtol=0, atol=1e-12)
        (out * expected.detach()).sum().backward()
        got = [x.grad.clone() for x in (q, k, v)]
        for x in (q, k, v):
            x.grad = None
        (expected * expected.detach()).sum().backward()
        for a, b in zip(got, (q.grad, k.grad, v.grad), strict=True):
            assert torch.allclose(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kernel", KERNELS)
def test_unselected_positions_are_zero_with_neg_inf_lse(kernel: str) -> None:
    """head_groups: a position a group does not select gives 0 and lse -inf, never NaN."""
    q = torch.randn(1, 12, 2, 4)
    out, lse = ringdilated.dilated_attention(
        q, q, q, [4, 4], [1, 2], kernel=kernel, return_lse=True
    )
    # Group 1 (head 1) uses rate 2, offset 1: positions 0, 2 of each segment are unselected.
    unselected = torch.tensor([p % 4 % 2 != 1 for p in range(12)])
    assert torch.all(out[0, unselected, 1] == 0)
    assert torch.all(torch.isneginf(lse[0, 1, unselected]))
    assert torch.all(torch.isfinite(lse[0, 1, ~unselected]))
    assert torch.all(torch.isfinite(lse[0, 0]))


def _large_score_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(1, 24, 3, 8, generator=g) * 40).to(dtype)
    k = (torch.randn(1, 24, 3, 8, generator=g) * 40).to(dtype)
    v = torch.randn(1, 24, 3, 8, generator=g).to(dtype)
    return q, k, v


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_large_scores_do_not_overflow(kernel: str, mode: str, dtype: torch.dtype) -> None:
    """Scores of magnitude ~1e4: finite, and within tolerance of the oracle.

    Merged results (longnet) carry the kernels' float32 lse, whose absolute precision at
    |lse| ~ 1e4 is one float32 ulp there (~1e-3): a merge weight exp(lse_a - lse) is then good to
    about that relative error. Half precision's tolerance absorbs it; for float32 the documented
    bound is 4 ulp(max |lse|) * max |v| (docs/semantics.md, "Precision of merged results").
    """
    q, k, v = _large_score_inputs(dtype)
    out, lse = ringdilated.dilated_attention(
        q, k, v, [8, 12], [1, 2], mode=mode, scale=1.0, kernel=kernel, return_lse=True
    )
    assert torch.isfinite(out).all()
    expected_out, expected_lse = oracle(
        q, k, v, [8, 12], [1, 2], mode=mode, scale=1.0, return_lse=True
    )
    assert float(expected_lse.abs().max()) > 5e3
    base_out, base_lse = dense_attention(q, k, v, [8, 12], [1, 2], mode=mode, scale=1.0)
    assert_within_tolerance(lse, expected_lse, base_lse, dtype=dtype, what="lse")
    if dtype == torch.float32 and mode == "longnet":
        ulp = torch.finfo(torch.float32).eps * float(expected_lse.abs().max())
        bound = 4 * ulp * float(v.abs().max())
        assert float((out.double() - expected_out).abs().max()) <= bound
    else:
        assert_within_tolerance(out, expected_out, base_out, what="out")


def test_inputs_are_not_modified() -> None:
    q, k, v = (torch.randn(2, 20, 4, 8, requires_grad=True) for _ in range(3))
    before = [x.detach().clone() for x in (q, k, v)]
    out = ringdilated.dilated_attention(q, k, v, [4, 8], [1, 2], mode="longnet", causal=True)
    out.sum().backward()
    for x, b in zip((q, k, v), before, strict=True):
        assert torch.equal(x.detach(), b)


def test_non_contiguous_inputs() -> None:
    """Transposed (B, H, L, D) storage gives the same result as contiguous input."""
    g = torch.Generator().manual_seed(1)
    base = torch.randn(3, 2, 4, 20, 8, generator=g, dtype=torch.float64)
    q, k, v = (x.transpose(1, 2) for x in base.unbind(0))
    assert not q.is_contiguous()
    out = ringdilated.dilated_attention(q, k, v, [5, 10], [1, 2])
    assert torch.allclose(out, oracle(q, k, v, [5, 10], [1, 2]), rtol=0, atol=1e-12)
