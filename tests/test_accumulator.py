"""The accumulator: exact, order-independent, -inf-safe log-sum-exp merging."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ringdilated.core import Accumulator, BlockOptions, merge_partials
from ringdilated.functional import default_resolver
from ringdilated.testing import FLOORS


def _partials(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cuts: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    kernel = default_resolver().kernel("reference")
    bounds = [0, *cuts, k.shape[2]]
    return [
        kernel.forward(q, k[:, :, a:b], v[:, :, a:b], BlockOptions(scale=1.0))
        for a, b in itertools.pairwise(bounds)
        if b > a
    ]


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = q.double() @ k.double().transpose(-1, -2)
    return torch.softmax(s, -1) @ v.double(), torch.logsumexp(s, -1)


@given(
    seed=st.integers(0, 2**31 - 1),
    cuts=st.lists(st.integers(1, 15), max_size=4),
    order=st.randoms(use_true_random=False),
)
def test_merge_is_order_independent_and_exact(seed: int, cuts: list[int], order) -> None:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    k, v = (torch.randn(1, 2, 16, 4, generator=g, dtype=torch.float64) for _ in range(2))
    parts = _partials(q, k, v, sorted(set(cuts)))
    order.shuffle(parts)
    # Left fold in one order, tree in another: associativity and commutativity.
    out, lse = parts[0]
    for part in parts[1:]:
        out, lse = merge_partials(out, lse, *part)
    while len(parts) > 1:
        parts = [
            merge_partials(*parts[i], *parts[i + 1]) if i + 1 < len(parts) else parts[i]
            for i in range(0, len(parts), 2)
        ]
    expected_out, expected_lse = _exact(q, k, v)
    for o, s in ((out, lse), parts[0]):
        assert torch.allclose(o, expected_out, rtol=0, atol=1e-12)
        assert torch.allclose(s, expected_lse, rtol=0, atol=1e-12)


def test_neg_inf_blocks_are_the_identity() -> None:
    out = torch.randn(3, 4)
    lse = torch.randn(3)
    empty_out, empty_lse = torch.zeros(3, 4), torch.full((3,), float("-inf"))
    for merged in (
        merge_partials(out, lse, empty_out, empty_lse),
        merge_partials(empty_out, empty_lse, out, lse),
    ):
        assert torch.equal(merged[0], out) and torch.equal(merged[1], lse)
    both_out, both_lse = merge_partials(empty_out, empty_lse, empty_out, empty_lse)
    assert torch.equal(both_out, empty_out) and torch.isneginf(both_lse).all()
    assert not torch.isnan(both_out).any()


def test_in_place_accumulator_on_strided_views() -> None:
    g = torch.Generator().manual_seed(0)
    state = Accumulator.empty((8, 4), (8,), torch.float32, torch.device("cpu"))
    outs = [torch.randn(4, 4, generator=g) for _ in range(3)]
    lses = [torch.randn(4, generator=g) * 5 for _ in range(3)]
    for o, s in zip(outs, lses, strict=True):
        Accumulator.add(state.out[1::2], state.lse[1::2], o, s)
    ref_out, ref_lse = outs[0].double(), lses[0].double()
    for o, s in zip(outs[1:], lses[1:], strict=True):
        ref_out, ref_lse = merge_partials(ref_out, ref_lse, o.double(), s.double())
    assert torch.allclose(state.out[1::2].double(), ref_out, atol=1e-6)
    assert torch.allclose(state.lse[1::2].double(), ref_lse, atol=1e-6)
    assert torch.all(state.out[0::2] == 0) and torch.isneginf(state.lse[0::2]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scores_of_magnitude_1e4_in_half_precision(dtype: torch.dtype) -> None:
    """Partials from half-precision blocks with scores ~1e4 merge without overflow, in float32."""
    g = torch.Generator().manual_seed(1)
    q = (torch.randn(1, 2, 6, 8, generator=g) * 35).to(dtype)
    k = (torch.randn(1, 2, 20, 8, generator=g) * 35).to(dtype)
    v = torch.randn(1, 2, 20, 8, generator=g).to(dtype)
    parts = _partials(q, k, v, [5, 11, 17])
    out, lse = parts[0]
    for part in parts[1:]:
        out, lse = merge_partials(out, lse, *part)
    expected_out, expected_lse = _exact(q, k, v)
    assert float(expected_lse.abs().max()) > 5e3
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert float((out.double() - expected_out).abs().max()) <= FLOORS[dtype] * 2
    assert float((lse.double() - expected_lse).abs().max()) <= 1e-6 * float(
        expected_lse.abs().max()
    )
