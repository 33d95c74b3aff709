"""Review cases for a query suffix on 4 gloo ranks (docs/spec.md, sections 1 and 3), checked as
tests/test_sharded_suffix.py checks its own: every rank's out, lse and gradients (``dlse``
included, sinks' gradients summed over ranks) against the float64 oracle's one-process suffix
call, and forward bytes equal to the minimum the oracle's mask implies."""

from __future__ import annotations

import pytest

from tests.distributed_harness import Workers
from tests.test_sharded_suffix import _case, _check, _run

CASES = {
    # a window reaching back over three shards to a suffix of 2 in the last one
    "window_spans_three_ranks": _case(
        query_length=2, shard_lengths=[2, 3, 3, 8], segments=[16], rates=[1], window=(13, 0)
    ),
    # a document starting before the suffix, windowed
    "document_starts_before_the_suffix": _case(
        query_length=9, cu_seqlens=[0, 2, 12, 16], segments=[16], rates=[1], window=(9, 0)
    ),
    # the suffix starting exactly on a shard boundary, a two-sided window
    "boundary_two_sided_window": _case(
        query_length=4, segments=[16], rates=[1], causal=False, window=(6, 3)
    ),
    # three ranks hold no query: their share of the sinks' gradient is 0, not lost or doubled
    "sinks_three_empty_ranks": _case(
        query_length=3, sinks=[0.5, -1.0], kernel="reference", segments=[16], rates=[1]
    ),
    "sinks_gqa_longnet": _case(
        query_length=5,
        sinks=[0.5, -1.0, 0.2, 0.1],
        heads=4,
        kv_heads=2,
        mode="longnet",
        segments=[4, 16],
        rates=[1, 4],
        kernel="reference",
    ),
    # batch row 0's suffix rows 11..15 are all padding: out 0, lse -inf there despite the sinks
    "suffix_all_padding_in_one_row_with_sinks": _case(
        query_length=5,
        batch=2,
        valid_runs=[(0, 11), (2, 16)],
        sinks=[0.5, -1.0],
        kernel="reference",
    ),
    "boundary_sinks_uneven": _case(
        query_length=12, shard_lengths=[4, 4, 4, 4], sinks=[0.1, 0.2], kernel="reference"
    ),
}


@pytest.mark.parametrize("communicator", ["ringpass", "allgather"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_four_ranks(workers4: Workers, name: str, communicator: str) -> None:
    case = {**CASES[name], "communicator": communicator}
    _check(case, _run(workers4, case), 4)
