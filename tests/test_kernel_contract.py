"""Every registered kernel meets the kernel contract (ringdilated.core.kernel), on its own.

These are the properties a ring needs: arbitrary causal offsets (blocks above, on and below the
diagonal), -inf lse for rows with no key, and blocks over split keys that merge, forward and
backward, into exactly the unsplit result when each backward gets the final merged out and lse.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ringdilated.core import BlockOptions, merge_partials
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
    out, lse = kernel.forward(q, k, v, BlockOptions(scale=scale, causal_offset=offset))
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
        opts = BlockOptions(scale=scale, causal_offset=None if offset is None else offset - start)
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
        opts = BlockOptions(scale=scale, causal_offset=None if offset is None else offset - start)
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
    out, lse = kernel.forward(q, q[:, :2], q[:, :2], BlockOptions(scale=0.3, causal_offset=-3))
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.isneginf(lse[..., :3]).all() and torch.isfinite(lse[..., 3:]).all()
    assert torch.all(out[..., :3, :] == 0)
    expected_out, expected_lse = dense(q, q[:, :2], q[:, :2], 0.3, -3)
    assert float((out.double() - expected_out).abs().max()) < 50 * FLOORS[dtype]
    # The inputs are exact in every dtype, so the float32 lse is good to float32 accumulation.
    assert torch.allclose(lse[..., 3:].double(), expected_lse[..., 3:], rtol=0, atol=1e-4)
