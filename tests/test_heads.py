"""Head parallelism's plan (ringdilated.core.plan.heads): the dealing rule, by hand, and a share's
blocks against the float64 oracle's heads."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ringdilated.core.plan.heads import deal_heads, head_costs, share_blocks
from ringdilated.core.plan.pattern import DilationPattern
from ringdilated.core.plan.window import as_window
from ringdilated.core.run.local import CallState, pattern_run
from ringdilated.registry import default_resolver
from ringdilated.testing import max_error, oracle


def test_head_costs_follow_the_pattern_by_hand() -> None:
    """L = 8192, segments [2048, 4096, 8192], rates [1, 2, 4], 3 heads: head i selects
    w_i / r_i positions in each of L / w_i segments, so costs (L / w_i) * (w_i / r_i)**2 are
    4 * 2048**2, 2 * 2048**2 and 1 * 2048**2: 4 : 2 : 1."""
    pattern = DilationPattern([2048, 4096, 8192], [1, 2, 4])
    assert head_costs(pattern, 8192, 3, 3) == (4 * 2048**2, 2 * 2048**2, 2048**2)


def test_dealing_balances_four_two_one() -> None:
    """6 heads, 2 per pattern, costs 4 4 2 2 1 1 (units of 2048**2) over 2 ranks: contiguous
    halves would give 10 and 4; the rule gives 7 and 7, each rank one head of each pattern."""
    pattern = DilationPattern([2048, 4096, 8192], [1, 2, 4])
    shares = deal_heads(pattern, 8192, 6, 6, 2)
    unit = 2048**2
    assert [s.cost for s in shares] == [7 * unit, 7 * unit]
    assert [s.q_heads for s in shares] == [(0, 2, 4), (1, 3, 5)]
    assert [s.kv_heads for s in shares] == [(0, 2, 4), (1, 3, 5)]


def test_dealing_keeps_equal_costs_consecutive_and_deals_remainders() -> None:
    """Equal costs (longnet, or one pattern): consecutive runs, one more head to the first
    H % P ranks."""
    for mode in ("longnet", "head_groups"):
        pattern = DilationPattern([16], [2], mode)
        shares = deal_heads(pattern, 32, 5, 5, 2)
        assert [s.q_heads for s in shares] == [(0, 1, 2), (3, 4)]


def test_dealing_with_fewer_kv_heads_than_ranks_replicates_kv_heads() -> None:
    """8 query heads reading 2 key/value heads (4 each) over 4 ranks: single query heads are
    dealt, two consecutive per rank, and each rank receives the one key/value head they read."""
    shares = deal_heads(DilationPattern([16], [2]), 32, 8, 2, 4)
    assert [s.q_heads for s in shares] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [s.kv_heads for s in shares] == [(0,), (0,), (1,), (1,)]


def test_dealing_whole_kv_groups_when_there_are_enough() -> None:
    """8 query heads, 4 key/value heads (2 each), 2 ranks: whole groups are dealt, so no
    key/value head is sent to two ranks."""
    shares = deal_heads(DilationPattern([8, 16], [1, 2]), 32, 8, 4, 2)
    held = [h for s in shares for h in s.kv_heads]
    assert sorted(held) == [0, 1, 2, 3]
    for s in shares:
        assert sorted({h // 2 for h in s.q_heads}) == list(s.kv_heads)


def test_too_few_heads_for_the_ranks_is_rejected_with_the_counts() -> None:
    with pytest.raises(ValueError, match="at least one query head per rank: 2 heads over 4"):
        deal_heads(DilationPattern([8], [1]), 16, 2, 2, 4)


@st.composite
def _problems(draw: st.DrawFn) -> dict:
    count = draw(st.integers(1, 3))
    seq_len = draw(st.integers(1, 24))
    segments = [draw(st.integers(1, 2 * seq_len)) for _ in range(count)]
    rates = [draw(st.integers(1, min(4, w))) for w in segments]
    mode = draw(st.sampled_from(["head_groups", "longnet"]))
    heads = draw(st.integers(max(count if mode == "head_groups" else 1, 2), 8))
    kv_heads = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    world = draw(st.integers(1, heads))
    return {
        "segments": segments, "rates": rates, "mode": mode, "heads": heads,
        "kv_heads": kv_heads, "seq_len": seq_len, "world": world,
        "causal": draw(st.booleans()), "seed": draw(st.integers(0, 2**31 - 1)),
    }  # fmt: skip


@given(problem=_problems())
def test_every_share_attends_exactly_its_heads(problem: dict) -> None:
    """Each rank's share, run on its heads' slices of q, k and v over the whole sequence, equals
    the oracle's output at those heads; the shares cover every head once."""
    p = problem
    pattern = DilationPattern(p["segments"], p["rates"], p["mode"])
    g = torch.Generator().manual_seed(p["seed"])
    q = torch.randn(1, p["seq_len"], p["heads"], 4, generator=g, dtype=torch.float64)
    k, v = (
        torch.randn(1, p["seq_len"], p["kv_heads"], 4, generator=g, dtype=torch.float64)
        for _ in range(2)
    )
    expected = oracle(q, k, v, p["segments"], p["rates"], mode=p["mode"], causal=p["causal"])
    shares = deal_heads(pattern, p["seq_len"], p["heads"], p["kv_heads"], p["world"])
    assert sorted(h for s in shares for h in s.q_heads) == list(range(p["heads"]))
    blocks = pattern.blocks(p["seq_len"], p["heads"], p["kv_heads"])
    kernel = default_resolver().kernel("reference")
    for share in shares:
        qs, ks, vs = (
            q[:, :, list(share.q_heads)],
            k[:, :, list(share.kv_heads)],
            v[:, :, list(share.kv_heads)],
        )
        run = pattern_run(
            kernel, pattern, qs, ks, window=as_window(p["causal"]), scale=None, dropout_p=0.0,
            blocks=share_blocks(blocks, share, p["heads"], p["kv_heads"]),
        )  # fmt: skip
        out, _ = run.forward(qs, ks, vs, CallState())
        assert max_error(out, expected[:, :, list(share.q_heads)]) < 1e-12
