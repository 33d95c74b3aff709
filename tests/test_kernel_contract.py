"""Every registered kernel meets the kernel contract (ringdilated.core.contract.kernel), on its own.

These are the properties a ring needs: arbitrary causal offsets (blocks above, on and below the
diagonal), -inf lse for rows with no key, and blocks over split keys that merge, forward and
backward, into exactly the unsplit result when each backward gets the final merged out and lse.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from ringdilated.core import BlockOptions, KeyWindow, merge_partials
from ringdilated.core.contract.kernel import (
    all_finite,
    finite_along,
    inputs_finite,
    mark_non_finite_problems,
    mark_non_finite_rows,
)
from ringdilated.functional import default_resolver
from ringdilated.testing import FLOORS
from ringdilated.testing.conformance import dense

KERNELS = ["sdpa", "reference"]


@st.composite
def blocks(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, int | None]:
    hkv = draw(st.integers(1, 3))
    h = hkv * draw(st.integers(1, 3))
    lq, lk = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    d = draw(st.sampled_from([1, 8, 16]))
    offset = draw(st.none() | st.integers(-lq - 1, lk + 1))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    n = draw(st.integers(1, 2))
    q = torch.randn(n, h, lq, d, generator=g, dtype=torch.float64)
    k = torch.randn(n, hkv, lk, d, generator=g, dtype=torch.float64)
    v = torch.randn(n, hkv, lk, d, generator=g, dtype=torch.float64)
    return q, k, v, draw(st.floats(0.1, 1.5)), offset


@pytest.mark.parametrize("name", KERNELS)
@given(block=blocks())
def test_forward_with_any_causal_offset(name: str, block: tuple) -> None:
    q, k, v, scale, offset = block
    kernel = default_resolver().kernel(name)
    out, lse = kernel.forward(q, k, v, BlockOptions(scale=scale, window=KeyWindow(None, offset)))
    expected_out, expected_lse = dense(q, k, v, scale, offset)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse))
    finite = ~torch.isneginf(expected_lse)
    assert torch.allclose(lse[finite], expected_lse[finite], rtol=0, atol=1e-10)
    assert torch.allclose(out, expected_out, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", KERNELS)
@given(block=blocks(), split=st.floats(0.0, 1.0))
def test_split_keys_merge_exactly_forward_and_backward(
    name: str, block: tuple, split: float
) -> None:
    """Keys [0, s) and [s, Lk) as two blocks: merge(forward) == whole, and the two backwards with
    the merged (out, lse) sum to the whole gradient. The ring's correctness rests on this."""
    q, k, v, scale, offset = block
    kernel = default_resolver().kernel(name)
    lk = k.shape[2]
    s = int(split * lk)
    parts = [(0, s), (s, lk)]
    partials = []
    for start, stop in parts:
        opts = BlockOptions(
            scale=scale, window=KeyWindow(None, None if offset is None else offset - start)
        )
        if stop > start:
            partials.append(kernel.forward(q, k[:, :, start:stop], v[:, :, start:stop], opts))
    out, lse = partials[0]
    for other in partials[1:]:
        out, lse = merge_partials(out, lse, *other)

    qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
    expected_out, expected_lse = dense(qr, kr, vr, scale, offset)
    assert torch.allclose(out, expected_out, rtol=0, atol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expected_lse))

    dout = torch.randn_like(q)
    expected = torch.autograd.grad((expected_out * dout).sum(), (qr, kr, vr))
    dq = torch.zeros_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for start, stop in parts:
        if stop == start:
            continue
        opts = BlockOptions(
            scale=scale, window=KeyWindow(None, None if offset is None else offset - start)
        )
        gq, gk, gv = kernel.backward(
            dout, q, k[:, :, start:stop], v[:, :, start:stop], out.to(q.dtype), lse, opts
        )
        dq += gq
        dk[:, :, start:stop] += gk
        dv[:, :, start:stop] += gv
    for actual, exp in zip((dq, dk, dv), expected, strict=True):
        assert torch.isfinite(actual).all()
        assert torch.allclose(actual, exp, rtol=0, atol=1e-9)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_lse_is_float32(name: str, dtype: torch.dtype) -> None:
    kernel = default_resolver().kernel(name)
    q = torch.randn(2, 4, 9, 8).to(dtype)
    out, lse = kernel.forward(
        q, q[:, :2], q[:, :2], BlockOptions(scale=0.3, window=KeyWindow(None, -3))
    )
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isneginf(lse[..., :3]).all() and torch.isfinite(lse[..., 3:]).all()
    assert torch.all(out[..., :3, :] == 0)
    expected_out, expected_lse = dense(q, q[:, :2], q[:, :2], 0.3, -3)
    assert float((out.double() - expected_out).abs().max()) < 50 * FLOORS[dtype]
    # The inputs are exact in every dtype, so the float32 lse is good to float32 accumulation.
    assert torch.allclose(lse[..., 3:].double(), expected_lse[..., 3:], rtol=0, atol=1e-4)


# Non-finite inputs: found on the device -----------------------------------------------------------

_HOST_READS = frozenset(
    {
        torch.ops.aten._local_scalar_dense.default,  # item(), bool(tensor), float(tensor)
        torch.ops.aten.nonzero.default,
        torch.ops.aten.equal.default,
        torch.ops.aten.masked_select.default,
        torch.ops.aten.repeat_interleave.Tensor,
        torch.ops.aten.allclose.default,
    }
)


class HostReads(TorchDispatchMode):
    """Every aten op that hands a device value to the host, as a list."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in _HOST_READS:
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _with_non_finite(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(7)
    q = torch.randn(2, 4, 20, 8, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, 24, 8, generator=g).to(dtype) for _ in range(2))
    q[0, 1, 3, 2] = float("nan")
    k[1, 0, 20, 5] = float("inf")
    v[0, 1, 2, 0] = float("-inf")
    return q, k, v, torch.randn(q.shape, generator=g).to(dtype)


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [None, 0, 4, -3])
def test_kernels_never_read_the_host_even_for_non_finite_inputs(
    name: str, dtype: torch.dtype, offset: int | None
) -> None:
    """docs/spec.md section 4: detecting NaN and infinity never reads device values on the host
    (each read is a synchronisation on a GPU). The built-in kernels call no op that does."""
    kernel = default_resolver().kernel(name)
    q, k, v, dout = _with_non_finite(dtype)
    options = BlockOptions(scale=0.3, window=KeyWindow(None, offset))
    with HostReads() as mode:
        out, lse = kernel.forward(q, k, v, options)
        kernel.backward(dout, q, k, v, out, lse, options)
    assert mode.reads == []
    assert bool(out[0, 1, 3].isnan().all()), "a NaN query's row is NaN"
    assert bool(torch.isfinite(out[1, 2:]).all()), "the other key/value head never sees it"


@pytest.mark.parametrize("name", KERNELS)
def test_the_deprecated_finite_flag_changes_nothing(name: str) -> None:
    """``BlockOptions.finite`` is always ``None`` from the driver; a plugin or caller that still
    sets it cannot make a built-in kernel skip its non-finite handling."""
    kernel = default_resolver().kernel(name)
    q, k, v, _ = _with_non_finite(torch.float32)
    results = [
        kernel.forward(q, k, v, BlockOptions(scale=0.3, window=KeyWindow(None, 0), finite=flag))
        for flag in (None, True, False)
    ]
    for out, lse in results[1:]:
        assert torch.equal(out.isnan(), results[0][0].isnan())
        assert torch.allclose(out, results[0][0], equal_nan=True)
        assert torch.allclose(lse, results[0][1], equal_nan=True)


def test_the_host_checks_remain_importable_for_code_off_the_hot_path() -> None:
    q, k, v, _ = _with_non_finite(torch.float32)
    assert not all_finite(q, k, v) and all_finite(torch.ones(3))
    assert inputs_finite(BlockOptions(scale=1.0, finite=True), q)
    assert not inputs_finite(BlockOptions(scale=1.0), q)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_finite_along_is_not_fooled_by_large_finite_values(dtype: torch.dtype) -> None:
    """A sum of finite values can overflow to inf; amax and amin cannot."""
    big = torch.finfo(dtype).max
    x = torch.full((2, 3, 64), big, dtype=dtype)
    x[1, 0, 5] = -big
    assert bool(finite_along(x, (-1,)).all()) and bool(finite_along(x, (-2, -1)).all())
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1, 2, 7] = bad
        assert finite_along(y, (-1,)).tolist() == [[True] * 3, [True, True, False]]
        assert finite_along(y, (-2, -1)).tolist() == [True, False]


def test_the_repairs_poison_exactly_their_rows_and_problems() -> None:
    q = torch.zeros(2, 4, 3, 2)  # heads 0, 1 read key/value head 0; heads 2, 3 read head 1
    k, v = torch.zeros(2, 2, 5, 2), torch.zeros(2, 2, 5, 2)
    q[0, 3, 1, 0] = float("nan")
    v[1, 0, 4, 1] = float("-inf")
    out, lse = torch.zeros(2, 4, 3, 2), torch.zeros(2, 4, 3)
    mark_non_finite_rows(out, lse, q, k, v, BlockOptions(scale=1.0, window=KeyWindow(None, -1)))
    bad_rows = torch.zeros(2, 4, 3, dtype=torch.bool)
    bad_rows[0, 3, 1] = True
    bad_rows[1, :2] = True
    bad_rows[..., 0] = False  # row 0 sees no key (offset -1): 0 and -inf, always
    assert torch.equal(lse.isnan(), bad_rows) and torch.equal(out.isnan().all(-1), bad_rows)
    assert bool(torch.isneginf(lse[..., 0]).all()) and bool((out[..., 0, :] == 0).all())
    dq, dk, dv = torch.zeros(2, 4, 3, 2), torch.zeros(2, 2, 5, 2), torch.zeros(2, 2, 5, 2)
    dout, lse = torch.zeros(2, 4, 3, 2), torch.zeros(2, 4, 3)
    lse[0, 0, 0] = float("-inf")  # a row that sees no key: fine
    mark_non_finite_problems(dq, dk, dv, dout, q, k, v, lse)
    problems = torch.tensor([[False, True], [True, False]])  # (n, key/value head)
    assert torch.equal(dk.isnan().all(-1).all(-1), problems)
    assert torch.equal(dv.isnan().all(-1).all(-1), problems)
    assert torch.equal(dq.isnan().all(-1).all(-1), problems.repeat_interleave(2, 1))
    lse[1, 3, 2] = float("inf")  # a merged lse of +inf: softmax is NaN for that row
    mark_non_finite_problems(dq, dk, dv, dout, q, k, v, lse)
    assert bool(dk[1, 1].isnan().all())
