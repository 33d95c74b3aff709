"""The float64 oracle's section 5 (docs/spec.md): key windows ``(left, right)`` on top of the
dilation pattern, softcapping and per-head attention sinks, against sums written query by query
from the spec's words (each query's visible keys listed by the rule, its softmax summed by hand);
sink gradients against finite differences."""

from __future__ import annotations

import math

import pytest
import torch

from ringdilated.testing import oracle

L, H, D = 12, 2, 4


def _inputs(seed: int, heads: int = H) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, L, heads, D, generator=g, dtype=torch.float64) for _ in range(3))  # type: ignore[return-value]


def _visible(
    p: int, h: int, w: int, r: int, offset: int, window: tuple[int | None, int | None]
) -> list[int]:
    """Keys of query ``p`` under one pattern ``(w, r, offset)`` (head ``h`` is irrelevant here)
    and ``window``: same segment, both selected (``(x % w) % r == offset``), ``p - left <= j <=
    p + right`` in positions."""
    left, right = window
    if (p % w) % r != offset:
        return []
    keys = []
    for j in range(L):
        if j // w != p // w or (j % w) % r != offset:
            continue
        if right is not None and j > p + right:
            continue
        if left is not None and j < p - left:
            continue
        keys.append(j)
    return keys


def _by_hand(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    patterns: list[list[tuple[int, int, int]]],
    window: tuple[int | None, int | None] = (None, None),
    softcap: float | None = None,
    sinks: list[float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (1, L, H, D), lse (1, H, L))``: for each head and query, the multiset of visible
    keys over the head's ``patterns``, ``exp(cap(score))`` per occurrence, the sink's
    ``exp(s_h)`` once in the denominator."""
    scale = D**-0.5
    out = torch.zeros(1, L, H, D, dtype=torch.float64)
    lse = torch.full((1, H, L), -math.inf, dtype=torch.float64)
    for h in range(H):
        for p in range(L):
            keys = [j for w, r, o in patterns[h] for j in _visible(p, h, w, r, o, window)]
            terms = []
            for j in keys:
                s = float(q[0, p, h] @ k[0, j, h]) * scale
                if softcap is not None:
                    s = softcap * math.tanh(s / softcap)
                terms.append((math.exp(s), j))
            total = sum(e for e, _ in terms) + (math.exp(sinks[h]) if sinks else 0.0)
            if total == 0.0:
                continue
            lse[0, h, p] = math.log(total)
            for e, j in terms:
                out[0, p, h] += e / total * v[0, j, h]
    return out, lse


@pytest.mark.parametrize("window", [(3, 0), (2, 1), (None, -1), (5, None), (0, 0)])
def test_a_window_on_a_dilated_pattern_counts_positions(
    window: tuple[int | None, int | None],
) -> None:
    """``head_groups`` with ``[4, 8] / [1, 2]``: head 0 the rate-1 pattern of 4, head 1 the
    rate-2 pattern of 8 at offset 1; the window bounds positions, not selected keys."""
    q, k, v = _inputs(1)
    out, lse = oracle(q, k, v, [4, 8], [1, 2], return_lse=True, window=window)
    want_out, want_lse = _by_hand(q, k, v, [[(4, 1, 0)], [(8, 2, 1)]], window)
    assert torch.allclose(out, want_out, atol=1e-12, rtol=0)
    assert torch.equal(lse.isneginf(), want_lse.isneginf())
    assert torch.allclose(lse, want_lse, atol=1e-12, rtol=0)


def test_longnet_mixing_with_a_window_is_one_softmax_over_the_union() -> None:
    """Each head uses both patterns (offsets ``h * r // H``); a key both select counts twice."""
    q, k, v = _inputs(2)
    out, lse = oracle(q, k, v, [4, 8], [1, 2], mode="longnet", return_lse=True, window=(4, 0))
    patterns = [[(4, 1, 0), (8, 2, 0)], [(4, 1, 0), (8, 2, 1)]]
    want_out, want_lse = _by_hand(q, k, v, patterns, (4, 0))
    assert torch.allclose(out, want_out, atol=1e-12, rtol=0)
    assert torch.allclose(lse, want_lse, atol=1e-12, rtol=0)


def test_causal_is_a_window_bounded_at_zero_on_the_right() -> None:
    q, k, v = _inputs(3)
    causal = oracle(q, k, v, [4, 8], [1, 2], causal=True, return_lse=True)
    window = oracle(q, k, v, [4, 8], [1, 2], window=(None, 0), return_lse=True)
    for a, b in zip(causal, window, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cap", [0.5, 2.0])
def test_softcapping_caps_each_score_before_the_softmax(cap: float) -> None:
    q, k, v = _inputs(4)
    q = q * 4  # scores well past the cap
    out, lse = oracle(q, k, v, [L], [1], return_lse=True, softcap=cap, window=(None, 0))
    want_out, want_lse = _by_hand(q, k, v, [[(L, 1, 0)]] * H, (None, 0), softcap=cap)
    assert torch.allclose(out, want_out, atol=1e-12, rtol=0)
    assert torch.allclose(lse, want_lse, atol=1e-12, rtol=0)


def test_sinks_join_each_denominator_once_and_keep_empty_rows_at_zero() -> None:
    """Per-head sink logits; ``window=(None, -1)`` leaves query 0 with no key: ``out = 0`` and
    ``lse = s_h`` there."""
    q, k, v = _inputs(5)
    sinks = [0.7, -1.3]
    out, lse = oracle(
        q, k, v, [4, 8], [1, 2], return_lse=True, window=(None, -1),
        sinks=torch.tensor(sinks, dtype=torch.float64),
    )  # fmt: skip
    want_out, want_lse = _by_hand(q, k, v, [[(4, 1, 0)], [(8, 2, 1)]], (None, -1), sinks=sinks)
    assert torch.allclose(out, want_out, atol=1e-12, rtol=0)
    assert torch.allclose(lse, want_lse, atol=1e-12, rtol=0)
    assert float(lse[0, 0, 0]) == pytest.approx(0.7, abs=1e-12)
    assert torch.equal(out[0, 0, 0], torch.zeros(D, dtype=torch.float64))


def test_the_sink_logits_get_their_gradient() -> None:
    q, k, v = _inputs(6)
    sinks = torch.tensor([0.2, -0.4], dtype=torch.float64, requires_grad=True)

    def loss(s: torch.Tensor) -> torch.Tensor:
        out, lse = oracle(
            q, k, v, [4, 8], [1, 2], mode="longnet", return_lse=True, window=(3, 0), sinks=s
        )
        return (out.sin().sum() + lse.cos().sum()).unsqueeze(0)

    assert torch.autograd.gradcheck(loss, (sinks,))


def test_causal_and_a_window_that_contradicts_it_raise() -> None:
    q, k, v = _inputs(7)
    with pytest.raises(ValueError, match=r"causal=True asks for right = 0, but window=\(3, 2\)"):
        oracle(q, k, v, [4, 8], [1, 2], causal=True, window=(3, 2))
    both = oracle(q, k, v, [4, 8], [1, 2], causal=True, window=(3, 0))
    assert torch.equal(both, oracle(q, k, v, [4, 8], [1, 2], window=(3, 0)))
