"""The dilation pattern: validation, head groups, offsets, coverage; blocks follow the rule of
docs/spec.md, section 2."""

from __future__ import annotations

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from ringdilated import DilationPattern
from ringdilated.core import CAUSAL, FULL
from tests.strategies import patterns


@given(pattern=patterns(), num_heads=st.integers(1, 40))
def test_head_group_sizes(pattern: tuple, num_heads: int) -> None:
    p = DilationPattern(*pattern)
    sizes = p.group_sizes(num_heads)
    G = p.num_patterns
    assert sum(sizes) == num_heads and len(sizes) == G
    assert all(s == num_heads // G + (i < num_heads % G) for i, s in enumerate(sizes))
    assert DilationPattern((1, 2, 3), (1, 1, 1)).group_sizes(8) == (3, 3, 2)


def test_head_group_offsets() -> None:
    p = DilationPattern((8, 16, 32), (1, 2, 4))
    runs = p.head_offsets(8)
    assert runs == ((0, 0, 0, 3), (1, 1, 3, 6), (2, 2, 6, 8))


@given(pattern=patterns(), num_heads=st.integers(1, 12))
def test_longnet_offsets_follow_the_rule_and_cover(pattern: tuple, num_heads: int) -> None:
    p = DilationPattern(*pattern, mode="longnet")
    for i, r in enumerate(p.dilation_rates):
        offsets = {}
        for index, offset, first, stop in p.head_offsets(num_heads):
            if index == i:
                for h in range(first, stop):
                    assert h not in offsets
                    offsets[h] = offset
        assert offsets == {h: (h * r) // num_heads for h in range(num_heads)}
        if num_heads >= r:
            assert set(offsets.values()) == set(range(r)), "heads together cover every position"


@given(
    pattern=patterns(),
    mode=st.sampled_from(["head_groups", "longnet"]),
    seq_len=st.integers(1, 50),
    heads=st.integers(1, 8),
    kv_divisor=st.integers(1, 8),
)
def test_blocks_select_exactly_the_rule(
    pattern: tuple, mode: str, seq_len: int, heads: int, kv_divisor: int
) -> None:
    p = DilationPattern(*pattern, mode=mode)
    assume(mode == "longnet" or heads >= p.num_patterns)  # head_groups needs H >= G
    kv = max(d for d in range(1, heads + 1) if heads % d == 0 and d <= kv_divisor)
    # Count, for every (pattern, head, position), how often the blocks select it.
    counts = torch.zeros(p.num_patterns, heads, seq_len, dtype=torch.int64)
    positions = torch.arange(seq_len).view(1, seq_len, 1, 1)
    for block in p.blocks(seq_len, heads, kv):
        run = block.heads
        assert run.num_heads % run.num_kv_heads == 0
        group = heads // kv
        for h in range(run.q_start, run.q_stop):
            assert h // group == run.kv_start + (h - run.q_start) // (
                run.num_heads // run.num_kv_heads
            )
        selected = block.selection.view(positions.expand(1, seq_len, 1, 1)).flatten()
        counts[block.index, run.q_start : run.q_stop, selected] += 1
    expected = torch.zeros_like(counts)
    for index, offset, first, stop in p.head_offsets(heads):
        w, r = p.segment_lengths[index], p.dilation_rates[index]
        rule = torch.tensor([(x % w) % r == offset for x in range(seq_len)], dtype=torch.int64)
        expected[index, first:stop] += rule
    assert torch.equal(counts, expected)


def test_selection_views_do_not_copy() -> None:
    p = DilationPattern((4, 8), (1, 2))
    x = torch.randn(2, 16, 2, 3)
    for block in p.blocks(16, 2, 2):
        view = block.selection.view(x)
        assert view.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


@pytest.mark.parametrize(
    ("segments", "rates", "mode", "error", "match"),
    [
        ((4, 8), (1,), "head_groups", ValueError, "same length"),
        (
            (4,),
            (5,),
            "head_groups",
            ValueError,
            r"dilation_rates\[0\] = 5 exceeds segment_lengths\[0\] = 4",
        ),
        ((0,), (1,), "head_groups", ValueError, "segment_lengths must be positive, got 0"),
        ((4,), (-1,), "head_groups", ValueError, "dilation_rates must be positive, got -1"),
        ((), (), "head_groups", ValueError, "at least one value"),
        ((4.0,), (1,), "head_groups", TypeError, "segment_lengths must hold ints, got 4.0"),
        ((True,), (1,), "head_groups", TypeError, "must hold ints, got True"),
        (
            4,
            (1,),
            "head_groups",
            TypeError,
            "segment_lengths must be a sequence of positive ints, got 4",
        ),
        ((4,), (1,), "dense", ValueError, "mode must be one of .* got 'dense'"),
    ],
)
def test_invalid_pattern_is_rejected_naming_the_rule(segments, rates, mode, error, match) -> None:
    with pytest.raises(error, match=match):
        DilationPattern(segments, rates, mode)


def test_pattern_is_frozen_and_hashable() -> None:
    p = DilationPattern([4, 8], [1, 2])
    assert p == DilationPattern((4, 8), (1, 2)) and hash(p) == hash(DilationPattern((4, 8), (1, 2)))
    with pytest.raises(AttributeError):
        p.mode = "longnet"  # type: ignore[misc]
    assert p.blocks(64, 4, 4) is p.blocks(64, 4, 4), "blocks are cached"


def test_flops_counts_only_the_pattern() -> None:
    p = DilationPattern((2048, 4096, 8192), (1, 2, 4))
    # Each group: L / w segments of 2048 selected positions; heads 3, 3, 2.
    L, D = 65536, 64
    expected = sum(
        h * (L // w) * 4 * 2048 * 2048 * D
        for h, w in zip((3, 3, 2), (2048, 4096, 8192), strict=True)
    )
    assert p.flops(L, 8, D) == expected


def test_shard_plan_splits_inner_and_crossing_segments() -> None:
    from ringdilated.core.plan.shards import payload, shard_plan

    p = DilationPattern((4, 12), (1, 2))
    # L = 16 over 2 ranks (shard 8): w=4 segments tile the shards; the w=12 segment [0, 12)
    # crosses; the partial last segment [12, 16) lies inside rank 1.
    plan0, plan1 = (shard_plan(p, 16, 2, 2, r, 2) for r in (0, 1))
    assert [b.index for b in plan0.inner] == [0] and len(plan0.crossings) == 1
    assert sorted(b.index for b in plan1.inner) == [0, 1] and len(plan1.crossings) == 1
    crossing = plan0.crossings[0]
    # Group 1 (head 1) uses offset 1: positions 1, 3, 5, 7 on rank 0 and 9, 11 on rank 1.
    assert [piece.count for piece in crossing.pieces] == [4, 2]
    assert payload(plan0, 0, 1, FULL).positions == ((1, 3, 5, 7),)
    assert payload(plan1, 1, 0, FULL).positions == ((1, 3),)
    assert not payload(plan1, 1, 0, CAUSAL), "causal: nothing goes to an earlier rank"
    with pytest.raises(ValueError, match="must be a multiple of the world size 3"):
        shard_plan(p, 16, 2, 2, 0, 3)
