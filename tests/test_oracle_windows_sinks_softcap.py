"""The float64 oracle's section 5 (docs/spec.md): key windows ``(left, right)`` on top of the
dilation pattern, softcapping and per-head attention sinks, against sums written query by query
from the spec's words (each query's visible keys listed by the rule, its softmax summed by hand);
sink gradients against finite differences."""

from __future__ import annotations

import math

import pytest
import torch

import ringdilated
from ringdilated.testing import assert_non_finite_rule, nan_allowed, oracle

L, H, D = 12, 2, 4


def _inputs(
    seed: int, heads: int = H, kv_heads: int | None = None, queries: int = L
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    kv = heads if kv_heads is None else kv_heads
    shapes = [(1, queries, heads, D), (1, L, kv, D), (1, L, kv, D)]
    return tuple(torch.randn(*shape, generator=g, dtype=torch.float64) for shape in shapes)  # type: ignore[return-value]


def _visible(
    p: int,
    w: int,
    r: int,
    offset: int,
    window: tuple[int | None, int | None],
    document: tuple[int, int] = (0, L),
) -> list[int]:
    """Keys of query ``p`` (a position of ``document`` ``[start, end)``) under one pattern
    ``(w, r, offset)`` and ``window``: same document and segment, both selected (``(x % w) % r
    == offset`` for ``x`` counted from the document's start), ``p - left <= j <= p + right``
    in positions."""
    left, right = window
    start, end = document
    if ((p - start) % w) % r != offset:
        return []
    keys = []
    for j in range(start, end):
        if (j - start) // w != (p - start) // w or ((j - start) % w) % r != offset:
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
    documents: list[tuple[int, int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (1, Lq, H, D), lse (1, H, Lq))``: for each head and query (the last ``Lq`` of the
    ``L`` positions; a position in none of ``documents`` is padding: no query, no key), the
    multiset of visible keys over the head's ``patterns``, ``exp(cap(score))`` per occurrence,
    the sink's ``exp(s_h)`` (never capped) once in the denominator. Query head ``h`` reads key
    head ``h // (H / Hkv)``."""
    scale = D**-0.5
    queries, heads, kv_heads = q.shape[1], q.shape[2], k.shape[2]
    group = heads // kv_heads
    documents = documents or [(0, L)]
    out = torch.zeros(1, queries, heads, D, dtype=torch.float64)
    lse = torch.full((1, heads, queries), -math.inf, dtype=torch.float64)
    for h in range(heads):
        for i in range(queries):
            p = L - queries + i
            document = next((d for d in documents if d[0] <= p < d[1]), None)
            if document is None:
                continue  # padding
            keys = [j for w, r, o in patterns[h] for j in _visible(p, w, r, o, window, document)]
            terms = []
            for j in keys:
                s = float(q[0, i, h] @ k[0, j, h // group]) * scale
                if softcap is not None:
                    s = softcap * math.tanh(s / softcap)
                terms.append((math.exp(s), j))
            total = sum(e for e, _ in terms) + (math.exp(sinks[h]) if sinks else 0.0)
            if total == 0.0:
                continue
            lse[0, h, i] = math.log(total)
            for e, j in terms:
                out[0, i, h] += e / total * v[0, j, h // group]
    return out, lse


def _assert_close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    out, lse = got
    assert torch.allclose(out, want[0], atol=1e-12, rtol=0)
    assert torch.equal(lse.isneginf(), want[1].isneginf())
    assert torch.allclose(lse, want[1], atol=1e-12, rtol=0)


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
    _assert_close(causal, _by_hand(q, k, v, [[(4, 1, 0)], [(8, 2, 1)]], (None, 0)))


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


def test_sinks_join_the_longnet_union_once() -> None:
    q, k, v = _inputs(8)
    sinks = [0.4, -0.9]
    got = oracle(
        q, k, v, [4, 8], [1, 2], mode="longnet", return_lse=True, window=(5, 1),
        sinks=torch.tensor(sinks, dtype=torch.float64),
    )  # fmt: skip
    patterns = [[(4, 1, 0), (8, 2, 0)], [(4, 1, 0), (8, 2, 1)]]
    _assert_close(got, _by_hand(q, k, v, patterns, (5, 1), sinks=sinks))


def test_softcap_comes_before_the_union_weights_and_never_caps_the_sink() -> None:
    """Keys both patterns select count twice (``log 2`` added after the cap); the sink, a
    logit of its own, is not capped (a cap of 0.5 would bound it by 0.5)."""
    q, k, v = _inputs(9)
    q = q * 4
    sinks = [2.5, -2.0]
    got = oracle(
        q, k, v, [4, 8], [1, 2], mode="longnet", return_lse=True, window=(6, None), softcap=0.5,
        sinks=torch.tensor(sinks, dtype=torch.float64),
    )  # fmt: skip
    patterns = [[(4, 1, 0), (8, 2, 0)], [(4, 1, 0), (8, 2, 1)]]
    _assert_close(got, _by_hand(q, k, v, patterns, (6, None), softcap=0.5, sinks=sinks))


def test_grouped_query_heads_keep_one_sink_per_query_head() -> None:
    q, k, v = _inputs(10, heads=4, kv_heads=2)
    sinks = [0.3, -0.6, 1.1, 0.0]
    got = oracle(
        q, k, v, [4, 8], [1, 2], return_lse=True, window=(3, 0),
        sinks=torch.tensor(sinks, dtype=torch.float64),
    )  # fmt: skip
    patterns = [[(4, 1, 0)], [(4, 1, 0)], [(8, 2, 1)], [(8, 2, 1)]]  # group i: offset i % r
    _assert_close(got, _by_hand(q, k, v, patterns, (3, 0), sinks=sinks))


def test_windows_count_positions_inside_documents_and_for_a_query_suffix() -> None:
    """Packed documents ``[0, 5) [5, 12)``: segments restart at 5; the last 7 positions are
    the queries."""
    q, k, v = _inputs(11, queries=7)
    sinks = [0.1, 0.2]
    got = oracle(
        q, k, v, [4, 8], [1, 2], return_lse=True, window=(3, 1),
        cu_seqlens=torch.tensor([0, 5, 12]), sinks=torch.tensor(sinks, dtype=torch.float64),
    )  # fmt: skip
    want = _by_hand(
        q, k, v, [[(4, 1, 0)], [(8, 2, 1)]], (3, 1), sinks=sinks, documents=[(0, 5), (5, 12)]
    )
    _assert_close(got, want)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_is_no_query_even_with_a_sink(side: str) -> None:
    """Padded positions: ``out = 0``, ``lse = -inf`` (no sink); the tokens count positions
    from their own first one."""
    q, k, v = _inputs(12)
    padding = torch.zeros(1, L, dtype=torch.bool)
    padding[0, :3] = side == "left"
    padding[0, L - 3 :] = side == "right"
    tokens = (3, L) if side == "left" else (0, L - 3)
    sinks = [0.5, -0.25]
    got = oracle(
        q, k, v, [4, 8], [1, 2], return_lse=True, window=(2, 0), key_padding_mask=padding,
        sinks=torch.tensor(sinks, dtype=torch.float64),
    )  # fmt: skip
    want = _by_hand(q, k, v, [[(4, 1, 0)], [(8, 2, 1)]], (2, 0), sinks=sinks, documents=[tokens])
    _assert_close(got, want)
    assert bool(got[1][0, :, padding[0]].isneginf().all())


def test_a_sink_of_minus_infinity_is_no_sink_and_a_nan_sink_is_never_hidden() -> None:
    q, k, v = _inputs(13)
    plain = oracle(q, k, v, [4, 8], [1, 2], return_lse=True, window=(None, -1))
    minus = torch.full((H,), -math.inf, dtype=torch.float64)
    got = oracle(q, k, v, [4, 8], [1, 2], return_lse=True, window=(None, -1), sinks=minus)
    for a, b in zip(got, plain, strict=True):
        assert torch.equal(a, b)
    nan = torch.tensor([math.nan, 0.0], dtype=torch.float64)
    out, lse = oracle(q, k, v, [4, 8], [1, 2], return_lse=True, window=(None, -1), sinks=nan)
    assert bool(out[0, :, 0].isnan().all()) and bool(lse[0, 0].isnan().all())  # query 0 too
    assert not bool(out[0, :, 1].isnan().any())


def test_a_sink_makes_a_row_of_only_minus_infinite_scores_zero_with_the_sink_as_its_lse() -> None:
    """Query 0 (causal) sees key 0 only, and ``q . k = -inf`` there (an infinite query entry
    against a negative key entry): ``exp(-inf) = 0`` and the sink keeps the denominator
    positive, so the exact result is ``out = 0``, ``lse = s_h``; the row gives its key and
    value nothing (``dq`` of that row is 0, key 0's ``dv`` is the other rows' alone); only
    ``dk`` meets ``0 * inf``. The library may give NaN on that row (docs/spec.md, section 5:
    the infinite input sits in the row's own kernel block), never a wrong finite number."""
    q, k, v = _inputs(15)
    q[0, 0, :, 0], k[0, 0, :, 0] = math.inf, -1.0
    sinks = torch.tensor([0.3, -0.2], dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out, lse = oracle(*leaves[:3], [L], [1], causal=True, return_lse=True, sinks=leaves[3])
    assert torch.equal(out[0, 0], torch.zeros(H, D, dtype=torch.float64))
    assert torch.equal(lse[0, :, 0], sinks)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(16), dtype=out.dtype)
    out.backward(dout)
    dq, _, dv, dsinks = (t.grad for t in leaves)
    assert dq is not None and dv is not None and dsinks is not None
    assert torch.equal(dq[0, 0], torch.zeros(H, D, dtype=torch.float64))
    assert bool(dv.isfinite().all()) and bool(dsinks.isfinite().all())
    rest = [t.clone().requires_grad_() for t in (q, k, v, sinks)]  # without query 0's gradient
    others = oracle(*rest[:3], [L], [1], causal=True, sinks=rest[3])
    others.backward(dout.index_fill(1, torch.tensor([0]), 0.0))
    assert rest[2].grad is not None
    torch.testing.assert_close(dv[0, 0], rest[2].grad[0, 0], rtol=1e-12, atol=1e-12)

    may_be_nan = nan_allowed(q, k, v, [L], [1])
    assert bool(may_be_nan[0, 0].all()) and not bool(may_be_nan[0, 1:].any())
    for kernel in ("reference", "sdpa"):
        got, got_lse = ringdilated.dilated_attention(
            q.float(), k.float(), v.float(), [L], [1], causal=True, sinks=sinks.float(),
            return_lse=True, kernel=kernel,
        )  # fmt: skip
        base = out.float()  # dense attention in float32 is the oracle rounded here
        assert_non_finite_rule(got, out, base, may_be_nan[..., None], what=kernel)
        assert_non_finite_rule(got_lse, lse, lse.float(), may_be_nan.transpose(1, 2), what=kernel)


def test_a_sink_of_plus_infinity_takes_the_whole_denominator() -> None:
    """``exp(+inf)`` outweighs every finite score: ``out = 0``, ``lse = +inf`` exactly (as the
    library computes); against a key score of ``+inf`` the weights are ``inf / inf``: out NaN,
    never 0 (lse ``+inf``)."""
    q, k, v = _inputs(17)
    sinks = torch.tensor([math.inf, 0.3], dtype=torch.float64)
    out, lse = oracle(q, k, v, [4, 8], [1, 2], return_lse=True, sinks=sinks)
    assert torch.equal(out[0, :, 0], torch.zeros(L, D, dtype=torch.float64))
    assert bool(lse[0, 0].isposinf().all()) and bool(lse[0, 1].isfinite().all())
    assert bool(out[0, :, 1].isfinite().all())
    for kernel in ("reference", "sdpa"):
        got, got_lse = ringdilated.dilated_attention(
            q, k, v, [4, 8], [1, 2], sinks=sinks, return_lse=True, kernel=kernel
        )
        assert torch.equal(got[0, :, 0], out[0, :, 0]) and torch.equal(got_lse[0, 0], lse[0, 0])
    q[0, 5, 0, 0], k[0, 4, 0, 0] = math.inf, 1.0  # query 5 sees key 4 (segment 4, rate 1)
    out, lse = oracle(q, k, v, [4, 8], [1, 2], return_lse=True, sinks=sinks)
    assert bool(out[0, 5, 0].isnan().all()) and bool(lse[0, 0, 5].isposinf())
    assert torch.equal(out[0, 6, 0], torch.zeros(D, dtype=torch.float64))


def test_padding_stays_no_query_with_a_nan_sink() -> None:
    """A padded position is no query (``out = 0``, ``lse = -inf``) whatever the sink, a NaN one
    included (the tokens' rows of that head are NaN), as the library computes."""
    q, k, v = _inputs(18)
    padding = torch.zeros(1, L, dtype=torch.bool)
    padding[0, :3] = True
    sinks = torch.tensor([math.nan, 0.3], dtype=torch.float64)
    kw = {"return_lse": True, "key_padding_mask": padding, "sinks": sinks}
    out, lse = oracle(q, k, v, [4, 8], [1, 2], **kw)
    assert torch.equal(out[0, :3], torch.zeros(3, H, D, dtype=torch.float64))
    assert bool(lse[0, :, :3].isneginf().all())
    assert bool(out[0, 3:, 0].isnan().all()) and bool(out[0, 3:, 1].isfinite().all())
    got, got_lse = ringdilated.dilated_attention(q, k, v, [4, 8], [1, 2], kernel="reference", **kw)
    assert torch.equal(got[0, :3], out[0, :3]) and torch.equal(got_lse[0, :, :3], lse[0, :, :3])


def test_float32_sinks_with_float64_inputs_give_the_float64_result() -> None:
    q, k, v = _inputs(14)
    sinks = torch.tensor([0.3, -0.7], dtype=torch.float32, requires_grad=True)
    out, lse = oracle(q, k, v, [4, 8], [1, 2], return_lse=True, window=(3, 0), sinks=sinks)
    want = _by_hand(q, k, v, [[(4, 1, 0)], [(8, 2, 1)]], (3, 0), sinks=sinks.tolist())
    _assert_close((out, lse), want)
    lse.sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.float32


_BAD = [
    ({"softcap": math.inf}, ValueError, "softcap must be None or a positive finite number, got "
     "inf"),
    ({"softcap": True}, ValueError, "got True"),
    ({"softcap": 0.0}, ValueError, "got 0.0"),
    ({"sinks": torch.zeros(1)}, ValueError, "sinks must have shape (2,), one logit per query "
     "head, got (1,)"),
    ({"sinks": torch.zeros(())}, ValueError, "got ()"),
    ({"sinks": torch.zeros(2, 1)}, ValueError, "got (2, 1)"),
    ({"sinks": torch.zeros(2, dtype=torch.long)}, TypeError, "sinks must be a floating tensor"),
    ({"sinks": [0.0, 0.0]}, TypeError, "sinks must be a floating tensor of shape (2,)"),
    ({"window": (1.5, 0)}, TypeError, "a KeyWindow bound must be an int or None, got 1.5"),
    ({"window": (True, False)}, TypeError, "got True"),
    ({"window": 3}, TypeError, "window must be (left, right) or a KeyWindow, got 3"),
]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "error", "message"), _BAD)
def test_bad_section_5_arguments_raise_naming_the_value(
    kwargs: dict[str, object], error: type[Exception], message: str
) -> None:
    q, k, v = _inputs(15)
    with pytest.raises(error) as caught:
        oracle(q, k, v, [4, 8], [1, 2], **kwargs)  # type: ignore[arg-type]
    assert message in str(caught.value)


def test_a_key_window_object_is_taken_as_its_bounds() -> None:
    from ringdilated.core import KeyWindow

    q, k, v = _inputs(16)
    got = oracle(q, k, v, [4, 8], [1, 2], return_lse=True, window=KeyWindow(2, 1))
    _assert_close(got, _by_hand(q, k, v, [[(4, 1, 0)], [(8, 2, 1)]], (2, 1)))
