"""A query suffix on a process group (docs/spec.md, sections 1 and 3), on real gloo groups of 2
and 4 ranks: the queries are the last ``Lq`` positions of the whole sequence, each rank passing
those in its own shard (none before the suffix). Every rank's out, lse and gradients must equal
its rows of the float64 oracle's single-process suffix call, and the bytes each rank sends must
equal the minimum, computed here from the oracle's mask restricted to the suffix's queries.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringdilated.testing import assert_within_tolerance, dense_attention, oracle, pattern_weights
from ringdilated.testing.communicators import (
    case_inputs,
    case_layout,
    case_sinks,
    communicator_cases,
    shard_slice,
)
from tests.distributed_harness import Workers
from tests.suffix_tasks import query_rows

TASKS = "tests.suffix_tasks"
EXAMPLES = 8 if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else 200
"""Property examples per world size: few by default, many under the ``thorough`` profile."""


def _case(**fields: Any) -> dict[str, Any]:
    case: dict[str, Any] = {
        "seed": 3, "batch": 1, "seq_len": 16, "heads": 2, "kv_heads": 2, "head_dim": 4,
        "dtype": "float64", "segments": [8, 16], "rates": [1, 2], "mode": "head_groups",
        "causal": True, "scale": None, "communicator": "ringpass",
    }  # fmt: skip
    case.update(fields)
    return case


def _expected_bytes(case: dict[str, Any], world: int) -> tuple[list[int], list[int], list[int]]:
    """Forward bytes each rank sends and receives, and the minimum each receives, from the
    oracle's mask: for every other rank, the distinct (key/value head, key position) pairs of
    this rank's shard that some *suffix* query of that rank sees. ``allgather`` sends each rank's
    union over its peers to every peer, padded to the largest union (one width per call of a
    group of rows of one padding)."""
    L, H, Hkv = case["seq_len"], case["heads"], case["kv_heads"]
    weights = pattern_weights(
        L, H, case["segments"], case["rates"], mode=case["mode"], causal=case["causal"],
        window=case.get("window"), **case_layout(case),
    )  # fmt: skip
    rows = case["batch"] if weights.shape[0] == 1 else 1
    shards = [shard_slice(case, r, world) for r in range(world)]
    queries = [query_rows(case, r, world) for r in range(world)]
    itemsize = torch.empty((), dtype=getattr(torch, case["dtype"])).element_size()
    per_pair = 2 * case["head_dim"] * itemsize
    sent, received = [0] * world, [0] * world
    width = 0
    for row in weights:
        sees = (row > 0).view(Hkv, H // Hkv, L, L).any(1)
        unions = []
        for src in range(world):
            seen_by_any = torch.zeros_like(sees[:, 0, shards[src]])
            for dst in range(world):
                if dst != src:
                    seen = sees[:, queries[dst], shards[src]].any(1)
                    sent[src] += per_pair * rows * int(seen.sum())
                    received[dst] += per_pair * rows * int(seen.sum())
                    seen_by_any |= seen
            unions.append(rows * int(seen_by_any.sum()))
        width += per_pair * max(unions)
    if case["communicator"] != "allgather":
        return sent, received, received
    return [(world - 1) * width] * world, [(world - 1) * width] * world, received


def _check(case: dict[str, Any], results: list[dict[str, Any]], world: int) -> None:
    """Every rank's results against the oracle's suffix call; its shapes; its bytes."""
    for r, result in enumerate(results):
        assert "error" not in result, (r, result.get("error"))
        rows = query_rows(case, r, world)
        n = rows.stop - rows.start
        b, h, d = case["batch"], case["heads"], case["head_dim"]
        assert result["out"].shape == result["dq"].shape == (b, n, h, d), r
        assert result["lse"].shape == (b, h, n), r
        if n == 0:  # a rank before the suffix: nothing to compute, its keys' gradients only
            assert result["dq"].numel() == 0
    q, k, v, dout, dlse = case_inputs(case)
    start = case["seq_len"] - case["query_length"]
    q, dout, dlse = q[:, start:], dout[:, start:], dlse[:, :, start:]
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    sinks = case_sinks(case)
    leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
    pattern = (case["segments"], case["rates"])
    kw: dict[str, Any] = {"mode": case["mode"], "causal": case["causal"], "scale": case["scale"]}
    kw.update(window=case.get("window"), softcap=case.get("softcap"), sinks=sinks)
    kw.update(case_layout(case))

    def loss(o: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        finite = s.masked_fill(torch.isneginf(s), 0).double()
        return (o.double() * dout.double()).sum() + (finite * dlse.double()).sum()

    expected_out, expected_lse = oracle(q, k, v, *pattern, **kw, return_lse=True)
    base_out, _ = dense_attention(q, k, v, *pattern, **kw)
    lse_dtype = torch.float32 if q.dtype == torch.float64 else q.dtype
    _, base_lse = dense_attention(q, k, v, *pattern, **kw, dtype=lse_dtype)
    out = torch.cat([r["out"] for r in results], 1)
    lse = torch.cat([r["lse"] for r in results], 2)
    assert_within_tolerance(out, expected_out, base_out, what="out")
    assert_within_tolerance(lse, expected_lse, base_lse, dtype=lse_dtype, what="lse")
    expected = torch.autograd.grad(loss(expected_out, expected_lse), leaves)
    baseline = torch.autograd.grad(loss(*dense_attention(q, k, v, *pattern, **kw)), leaves)
    grads = [torch.cat([r[name] for r in results], 1) for name in ("dq", "dk", "dv")]
    if sinks is not None:
        grads.append(torch.stack([r["dsinks"] for r in results]).sum(0))
    for name, a, e, b in zip("qkvs"[: len(grads)], grads, expected, baseline, strict=True):
        assert_within_tolerance(a, e, b, what=f"d{name}")
    if case["communicator"] not in ("ringpass", "allgather"):  # others: tests/test_distributed.py
        return
    sent, received, minimum = _expected_bytes(case, world)
    assert [r["forward_bytes_sent"] for r in results] == sent
    assert [r["forward_bytes_received"] for r in results] == received
    assert [r["total_bytes_sent"] for r in results] == [
        2 * s + m for s, m in zip(sent, minimum, strict=True)
    ]


def _run(pool: Workers, case: dict[str, Any]) -> list[dict[str, Any]]:
    return pool.results(f"{TASKS}:suffix_run", case)


TWO_RANKS = {
    "mid_shard_dilated_causal": _case(query_length=5),
    "shard_boundary_bidirectional": _case(query_length=8, causal=False),
    "whole_sequence": _case(query_length=16),
    "one_query_longnet_gqa": _case(
        query_length=1, mode="longnet", heads=4, kv_heads=2, segments=[4, 16], rates=[1, 4]
    ),
    "dense_sliding_window": _case(query_length=6, segments=[16], rates=[1], window=(5, 0)),
    "bidirectional_window": _case(
        query_length=11, segments=[16], rates=[1], causal=False, window=(3, 2)
    ),
    "uneven_partial_first_shard": _case(query_length=13, shard_lengths=[5, 11]),
    "uneven_suffix_in_last_shard": _case(query_length=9, shard_lengths=[5, 11], causal=False),
    "documents": _case(query_length=7, cu_seqlens=[0, 6, 11, 16]),
    "padding": _case(query_length=10, batch=2, valid_runs=[(0, 13), (3, 16)]),
    "sinks_softcap": _case(
        query_length=6, sinks=[0.5, -1.0], softcap=2.0, kernel="reference", causal=False
    ),
    "auto_communicator": _case(query_length=5, communicator="auto"),
}


@pytest.mark.parametrize(
    ("name", "communicator"),
    [
        (name, communicator)
        for name in sorted(TWO_RANKS)
        for communicator in (
            ("auto",) if TWO_RANKS[name]["communicator"] == "auto" else ("ringpass", "allgather")
        )
    ],
)
def test_two_ranks(workers2: Workers, name: str, communicator: str) -> None:
    case = {**TWO_RANKS[name], "communicator": communicator}
    _check(case, _run(workers2, case), 2)


FOUR_RANKS = {
    "two_empty_ranks_dilated": _case(
        query_length=6, segments=[4, 8, 16], rates=[1, 2, 4], heads=3, kv_heads=1
    ),
    "one_query": _case(query_length=1, segments=[16], rates=[1], window=(6, 0)),
    "uneven_window": _case(
        query_length=3, shard_lengths=[3, 5, 4, 4], segments=[16], rates=[1], window=(6, 0)
    ),
    "documents_bidirectional": _case(query_length=11, cu_seqlens=[0, 3, 9, 16], causal=False),
    "boundary_longnet": _case(query_length=8, mode="longnet", segments=[8, 16], rates=[2, 4]),
}


@pytest.mark.parametrize("communicator", ["ringpass", "allgather"])
@pytest.mark.parametrize("name", sorted(FOUR_RANKS))
def test_four_ranks(workers4: Workers, name: str, communicator: str) -> None:
    case = {**FOUR_RANKS[name], "communicator": communicator}
    _check(case, _run(workers4, case), 4)


@pytest.mark.parametrize(
    ("world", "q_lengths"),
    [
        (2, [3, 2]),  # rank 1 must hold its whole shard after rank 0's partial tail
        (2, [0, 0]),  # no query at all
        (2, [4, 0]),  # a suffix must reach the end of the sequence
        (4, [0, 2, 0, 4]),  # a gap
    ],
)
def test_an_invalid_split_raises_on_every_rank(
    workers2: Workers, workers4: Workers, world: int, q_lengths: list[int]
) -> None:
    pool = workers2 if world == 2 else workers4
    case = _case(query_length=0, q_lengths=q_lengths, seq_len=8 * world // 2)
    results = _run(pool, case)
    messages = {tuple(r["error"]) for r in results}
    assert len(messages) == 1, messages
    kind, message = messages.pop()
    assert kind == "ValueError"
    assert "the queries are the last Lq positions of the whole sequence" in message
    assert f"got q lengths {tuple(q_lengths)}" in message


@pytest.mark.parametrize("communicator", ["ulysses", "hybrid"])
def test_head_parallel_communicators_refuse_a_suffix_on_every_rank(
    workers4: Workers, communicator: str
) -> None:
    case = _case(query_length=6, communicator=communicator, heads=4, kv_heads=2)
    results = _run(workers4, case)
    messages = {tuple(r["error"]) for r in results}
    assert len(messages) == 1, messages
    kind, message = messages.pop()
    assert kind in ("ValueError", "ResolutionError")
    assert communicator in message and "query suffix" in message
    assert "ringpass" in message and "allgather" in message


def test_head_parallel_still_serves_the_whole_sequence(workers4: Workers) -> None:
    case = _case(query_length=16, communicator="ulysses", heads=4, kv_heads=2)
    _check(case, _run(workers4, case), 4)


def test_a_layout_binds_the_split_and_plain_calls_replan(workers2: Workers) -> None:
    """Rank 0 holds no query in either call (same shapes), rank 1 holds 3, then 5."""
    case = _case(query_length=0, causal=False)
    results = workers2.results(f"{TASKS}:changing_suffix", {"case": case, "lengths": (3, 5)})
    q, k, v, _, _ = case_inputs(case)
    for n, index in ((3, 0), (5, 1)):
        expected = oracle(q[:, 16 - n :], k, v, case["segments"], case["rates"])
        base = dense_attention(q[:, 16 - n :], k, v, case["segments"], case["rates"])[0]
        got = torch.cat([r["plain"][index] for r in results], 1)
        assert_within_tolerance(got, expected, base, what=f"plain call {index}")
        if index == 0:
            got = torch.cat([r["layout_first"] for r in results], 1)
            assert_within_tolerance(got, expected, base, what="layout's first call")
    assert results[0]["layout_second"] == "not called"
    message = results[1]["layout_second"]
    assert "q (1, 5, 2, 4)" in message and "its q holds the last 3" in message, message
    assert "build a new layout" in message
    own, peer = results[1]["layout_other"], results[0]["layout_other"]
    assert "this call's q holds 5 positions but its SequenceLayout's first call held 3" in own
    assert "rank 1" in peer and "held 3" in peer, peer


@pytest.mark.parametrize("world", [2, 4])
@settings(max_examples=EXAMPLES)
@given(data=st.data())
def test_property(workers2: Workers, workers4: Workers, world: int, data: st.DataObject) -> None:
    """Random problems (pattern, mode, heads, windows, sinks, softcap, documents or padding,
    uneven shards) with a random suffix, ringpass or allgather."""
    case = data.draw(communicator_cases(world, sinks=True, softcap=True))
    case["query_length"] = data.draw(st.integers(1, case["seq_len"]))
    case["communicator"] = data.draw(st.sampled_from(["ringpass", "allgather"]))
    _check(case, _run(workers2 if world == 2 else workers4, case), world)


def test_the_compiled_op_serves_a_suffix(workers2: Workers) -> None:
    """The custom op under ``torch.compile(fullgraph=True)`` with rank 0 holding no query."""
    case = _case(query_length=6)
    results = workers2.results(f"{TASKS}:compiled_suffix", case)
    assert results[0]["out"].shape == (1, 0, 2, 4)
    q, k, v, dout, _ = case_inputs(case)
    q, k, v = (x.clone().requires_grad_() for x in (q[:, 10:], k, v))
    pattern = (case["segments"], case["rates"])
    expected = oracle(q, k, v, *pattern, causal=True)
    base = dense_attention(q, k, v, *pattern, causal=True)[0]
    out = torch.cat([r["out"] for r in results], 1)
    assert_within_tolerance(out, expected, base, what="out")
    wanted = torch.autograd.grad((expected * dout[:, 10:]).sum(), (q, k, v))
    baseline = torch.autograd.grad((base * dout[:, 10:]).sum(), (q, k, v))
    for name, e, b in zip("qkv", wanted, baseline, strict=True):
        got = torch.cat([r[f"d{name}"] for r in results], 1)
        assert_within_tolerance(got, e, b, what=f"d{name}")


def _plans(query_start: int, world: int = 4) -> tuple[Any, ...]:
    from ringdilated.core.plan.pattern import DilationPattern
    from ringdilated.core.plan.shards import shard_plan

    pattern = DilationPattern([4, 16], [1, 2])
    return tuple(
        shard_plan(pattern, 16, 4, 2, r, world, None, None, query_start) for r in range(world)
    )


def test_auto_never_picks_a_head_parallel_communicator_for_a_suffix() -> None:
    """The resolver alone: with a suffix ``auto`` chooses sequence parallelism, and a forced
    ``ulysses`` names why it cannot serve (every rank makes the same choice from the same
    plans)."""
    from ringdilated.core.plan.window import CAUSAL
    from ringdilated.core.select.communicator_spec import SUFFIX_REFUSED
    from ringdilated.core.select.cost import PieceSize
    from ringdilated.core.select.resolver import ResolutionError
    from ringdilated.registry import default_resolver

    resolver, size = default_resolver(), PieceSize(1, 64, 2)
    for start in (1, 10, 15):
        chosen = resolver.choose_communicator(4, CAUSAL, "auto", _plans(start), size)
        assert chosen.parallelism == "sequence", (start, chosen.name)
        with pytest.raises(ResolutionError, match="cannot serve a query suffix"):
            resolver.choose_communicator(4, CAUSAL, "ulysses", _plans(start), size)
        spec = resolver.communicator_specs["ulysses"]
        assert SUFFIX_REFUSED in spec.reasons(4, CAUSAL, _plans(start))
    assert not resolver.communicator_specs["ulysses"].reasons(4, CAUSAL, _plans(0))


def test_a_rank_before_the_suffix_plans_no_work_and_receives_nothing() -> None:
    """Shards of 4 of 16 positions, queries from 10 on: ranks 0 and 1 hold none (no inner
    block), rank 2 holds its last 2, and every payload goes to ranks 2 and 3 only."""
    from ringdilated.core.plan.shards import payload
    from ringdilated.core.plan.window import FULL

    plans = _plans(10)
    assert [p.query_length for p in plans] == [0, 0, 2, 4]
    assert [p.query_origin for p in plans] == [4, 4, 2, 0]
    assert plans[0].inner == plans[1].inner == ()
    for src in range(4):
        for dst in (0, 1):
            assert not payload(plans[src], src, dst, FULL), (src, dst)
    assert any(payload(plans[0], 0, dst, FULL) for dst in (2, 3))  # its keys still travel


def test_the_split_rule_names_every_rank() -> None:
    from ringdilated.core.call.validation import check_query_split

    assert check_query_split((4, 4, 4, 4), (0, 0, 2, 4)) == 6
    assert check_query_split((3, 5), (1, 5)) == 6
    with pytest.raises(ValueError, match=r"got q lengths \(0, 3, 3\) on shards of \(4, 4, 4\)"):
        check_query_split((4, 4, 4), (0, 3, 3))
    with pytest.raises(ValueError, match=r"Lq = 0"):
        check_query_split((4, 4), (0, 0))


def test_a_layout_with_uneven_shards_and_documents_serves_a_suffix(workers2: Workers) -> None:
    """The layout holds the shard lengths (no length is gathered): the suffix alone makes the
    second agreement; its second call runs the kept plan, with no host read, host copy or
    control collective (counted)."""
    case = _case(query_length=13, shard_lengths=[5, 11], cu_seqlens=[0, 4, 16])
    results = workers2.results(f"{TASKS}:suffix_on_a_layout", case)
    q, k, v, _, _ = case_inputs(case)
    kw = {"causal": True, **case_layout(case)}
    expected = oracle(q[:, 3:], k, v, case["segments"], case["rates"], **kw)
    base = dense_attention(q[:, 3:], k, v, case["segments"], case["rates"], **kw)[0]
    assert [r["outs"][0].shape[1] for r in results] == [2, 11]
    for call in (0, 1):
        got = torch.cat([r["outs"][call] for r in results], 1)
        assert_within_tolerance(got, expected, base, what=f"call {call}")
    # The kept plan: no host read, no copy, no collective but the data exchange.
    assert [r["counts"] for r in results] == [(0, 0, 0), (0, 0, 0)], [r["events"] for r in results]
