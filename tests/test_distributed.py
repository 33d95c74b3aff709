"""Sharded dilated attention on real gloo process groups of 2 and 4 ranks (docs/spec.md, section 3).

Every rank's out, lse and gradients must equal its slice of the float64 oracle's (tolerance rule
of docs/spec.md, section 4), and the bytes each rank sends must equal the analytic minimum, computed
here independently from the oracle's mask: for every other rank, the distinct (key/value head,
key position) pairs of this rank's shard that some query of that rank sees.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ringdilated.testing import (
    assert_within_tolerance,
    dense_attention,
    max_error,
    oracle,
    pattern_weights,
)
from ringdilated.testing.communicators import (
    case_layout,
    case_sinks,
    communicator_cases,
    grid_shape,
    shard_slice,
)
from tests.distributed_harness import TASKS, Workers, full_inputs


def _expected_bytes(
    case: dict[str, Any], world: int, broadcast: bool
) -> tuple[list[int], list[int], list[int]]:
    """Forward bytes each rank sends and receives, and the minimum each receives, computed
    independently from the oracle's mask.

    The minimum: for every other rank, the distinct (key/value head, key position) pairs of this
    rank's shard that some query of that rank sees. A broadcast communicator (allgather) sends
    one payload to every other rank instead: the union of those pairs over all other ranks,
    padded to the largest rank's union (per call: padded rows run one call per padding)."""
    L, H, Hkv = case["seq_len"], case["heads"], case["kv_heads"]
    weights = pattern_weights(
        L, H, case["segments"], case["rates"], mode=case["mode"], causal=case["causal"],
        window=case.get("window"), **case_layout(case),
    )  # fmt: skip
    rows = case["batch"] if weights.shape[0] == 1 else 1  # rows that each weight row stands for
    shards = [shard_slice(case, r, world) for r in range(world)]
    itemsize = torch.empty((), dtype=getattr(torch, case["dtype"])).element_size()
    per_pair = 2 * case["head_dim"] * itemsize
    minimum_sent, minimum_received = [0] * world, [0] * world
    width = 0  # bytes of one broadcast payload, summed over the calls of padded row groups
    for row in weights:
        sees = (row > 0).view(Hkv, H // Hkv, L, L).any(1)  # (Hkv, query, key)
        unions = []
        for src in range(world):
            seen_by_any = torch.zeros_like(sees[:, 0, shards[src]])
            for dst in range(world):
                if dst != src:
                    seen = sees[:, shards[dst], shards[src]].any(1)
                    pairs = rows * int(seen.sum())
                    minimum_sent[src] += per_pair * pairs
                    minimum_received[dst] += per_pair * pairs
                    seen_by_any |= seen
            unions.append(rows * int(seen_by_any.sum()))
        # Rows of one padding run as one call, rows of another as their own: one width each.
        width += per_pair * max(unions)
    if not broadcast:
        return minimum_sent, minimum_received, minimum_received
    return [(world - 1) * width] * world, [(world - 1) * width] * world, minimum_received


def _ulysses_bytes(case: dict[str, Any], world: int) -> tuple[list[int], list[int]]:
    """Forward bytes of head parallelism, given the dealing (tests/test_heads.py checks it): a
    rank sends each peer its shard of the peer's query heads and of the key/value heads they
    read, and returns to each peer that peer's positions of its own heads' out and lse."""
    from ringdilated.core.plan.heads import deal_heads
    from ringdilated.core.plan.pattern import DilationPattern

    pattern = DilationPattern(case["segments"], case["rates"], case["mode"])
    shares = deal_heads(pattern, case["seq_len"], case["heads"], case["kv_heads"], world)
    itemsize = torch.empty((), dtype=getattr(torch, case["dtype"])).element_size()
    row = case["batch"] * case["head_dim"] * itemsize  # one position of one head
    lse = case["batch"] * (8 if itemsize == 8 else 4)
    n = [shard_slice(case, r, world).stop - shard_slice(case, r, world).start for r in range(world)]
    sent, received = [0] * world, [0] * world
    for src in range(world):
        for dst in range(world):
            if src != dst:
                inputs = n[src] * row * (len(shares[dst].q_heads) + 2 * len(shares[dst].kv_heads))
                results = n[dst] * len(shares[src].q_heads) * (row + lse)
                sent[src] += inputs + results
                received[dst] += inputs + results
    return sent, received


def _hybrid_bytes(case: dict[str, Any], world: int) -> tuple[list[int], list[int]]:
    """Forward bytes on the kit's 2-D layout ``(outer, inner)``: within each inner group, head
    parallelism over the group's chunk (as ``_ulysses_bytes``, shares dealt over ``inner``
    ranks); across the outer group, the minimum for the rank's share of heads: the distinct
    (key/value head of the share, key position of this chunk) pairs that some query of the
    share's heads in another chunk sees, from the oracle's mask."""
    from ringdilated.core.plan.heads import deal_heads
    from ringdilated.core.plan.pattern import DilationPattern

    outer, inner = grid_shape(world)
    L, H, Hkv = case["seq_len"], case["heads"], case["kv_heads"]
    pattern = DilationPattern(case["segments"], case["rates"], case["mode"])
    shares = deal_heads(pattern, L, H, Hkv, inner)
    itemsize = torch.empty((), dtype=getattr(torch, case["dtype"])).element_size()
    row = case["batch"] * case["head_dim"] * itemsize
    lse = case["batch"] * (8 if itemsize == 8 else 4)
    shards = [shard_slice(case, r, world) for r in range(world)]
    n = [s.stop - s.start for s in shards]
    sent, received = [0] * world, [0] * world
    for o in range(outer):
        for a in range(inner):
            for b in range(inner):
                if a != b:
                    src, dst = o * inner + a, o * inner + b
                    heads_in = len(shares[b].q_heads) + 2 * len(shares[b].kv_heads)
                    moved = n[src] * row * heads_in + n[dst] * len(shares[a].q_heads) * (row + lse)
                    sent[src] += moved
                    received[dst] += moved
    weights = pattern_weights(
        L, H, case["segments"], case["rates"], mode=case["mode"], causal=case["causal"],
        window=case.get("window"), **case_layout(case),
    )  # fmt: skip
    rows = case["batch"] if weights.shape[0] == 1 else 1
    chunk = [
        slice(shards[o * inner].start, shards[o * inner + inner - 1].stop) for o in range(outer)
    ]
    group = H // Hkv
    for weight in weights:
        for i, share in enumerate(shares):
            heads = torch.tensor(share.q_heads)
            sees = weight[heads] > 0  # (share heads, query, key)
            per_kv = torch.stack([sees[heads // group == j].any(0) for j in share.kv_heads])
            for c in range(outer):
                for d in range(outer):
                    if c != d:
                        pairs = int(per_kv[:, chunk[d], chunk[c]].any(1).sum())
                        sent[c * inner + i] += 2 * row * rows * pairs // case["batch"]
                        received[d * inner + i] += 2 * row * rows * pairs // case["batch"]
    return sent, received


def _check(case: dict[str, Any], results: list[dict[str, Any]], world: int) -> None:
    q, k, v, dout, dlse = (x.requires_grad_(i < 3) for i, x in enumerate(full_inputs(case)))
    pattern = (case["segments"], case["rates"])
    kw = {"mode": case["mode"], "causal": case["causal"], "scale": case["scale"]}
    kw.update(window=case.get("window"), **case_layout(case))
    sinks = case_sinks(case)
    kw.update(softcap=case.get("softcap"), sinks=sinks)
    leaves = (q, k, v) if sinks is None else (q, k, v, sinks)
    out = torch.cat([r["out"] for r in results], 1)
    assert [r["out"].shape[1] for r in results] == [
        shard_slice(case, r, world).stop - shard_slice(case, r, world).start for r in range(world)
    ]
    lse = torch.cat([r["lse"] for r in results], 2)
    grads = [torch.cat([r[name] for r in results], 1) for name in ("dq", "dk", "dv")]

    def loss(o: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (o.double() * dout.double()).sum() + (
            s.masked_fill(torch.isneginf(s), 0).double() * dlse.double()
        ).sum()

    expected_out, expected_lse = oracle(q, k, v, *pattern, **kw, return_lse=True)
    base_out, base_lse = dense_attention(q, k, v, *pattern, **kw)
    lse_dtype = torch.float32 if q.dtype == torch.float64 else q.dtype
    _, base_lse = dense_attention(q, k, v, *pattern, **kw, dtype=lse_dtype)
    assert_within_tolerance(out, expected_out, base_out, what="out")
    assert_within_tolerance(lse, expected_lse, base_lse, dtype=lse_dtype, what="lse")
    expected = torch.autograd.grad(loss(expected_out, expected_lse), leaves)
    baseline = torch.autograd.grad(loss(*dense_attention(q, k, v, *pattern, **kw)), leaves)
    if sinks is not None:  # each rank's share of the sinks' gradient, summed over the ranks
        grads.append(torch.stack([r["dsinks"] for r in results]).sum(0))
    for name, a, e, b in zip("qkvs"[: len(grads)], grads, expected, baseline, strict=True):
        assert_within_tolerance(a, e, b, what=f"d{name}")
    if case["communicator"] == "auto":  # the choice is the cost model's (tests/test_resolver.py)
        return
    if case["communicator"] in ("ulysses", "hybrid"):
        expected = _ulysses_bytes if case["communicator"] == "ulysses" else _hybrid_bytes
        sent, received = expected(case, world)
        assert [r["forward_bytes_sent"] for r in results] == sent
        assert [r["forward_bytes_received"] for r in results] == received
        return
    sent, received, minimum = _expected_bytes(case, world, case["communicator"] == "allgather")
    assert [r["forward_bytes_sent"] for r in results] == sent
    assert [r["forward_bytes_received"] for r in results] == received
    # Backward sends each rank's pieces again and returns the gradients of the pieces it received
    # (always the minimum: point to point).
    assert [r["total_bytes_sent"] for r in results] == [
        2 * s + m for s, m in zip(sent, minimum, strict=True)
    ]


def _run_and_check(pool: Workers, case: dict[str, Any], world: int) -> None:
    """Run on every rank: every built-in communicator serves every problem, except that
    ``ulysses`` declines fewer query heads than ranks, on every rank alike."""
    results = pool.results("sharded_case", case)
    if case["communicator"] == "ulysses" and case["heads"] < world:
        assert all("at least one query head per rank" in r.get("declined", "") for r in results)
        return
    if case["communicator"] == "hybrid" and case["heads"] < grid_shape(world)[1]:
        assert all("needs at least 2 query heads" in r.get("declined", "") for r in results)
        return
    assert all("declined" not in r for r in results), results
    _check(case, results, world)


def _run_each_communicator(pool: Workers, case: dict[str, Any], world: int) -> None:
    """The same problem through ``ringpass``, ``allgather``, ``ulysses`` and ``hybrid`` (on the
    kit's 2-D mesh): each exact, each with its own bytes (checked in ``_check``)."""
    for communicator in ("ringpass", "allgather", "ulysses", "hybrid"):
        _run_and_check(pool, {**case, "communicator": communicator}, world)


@pytest.mark.parametrize("kernel", ["sdpa", "reference"])
@given(data=st.data())
def test_two_ranks_match_the_oracle(workers2: Workers, kernel: str, data: st.DataObject) -> None:
    _run_each_communicator(workers2, {**data.draw(communicator_cases(2)), "kernel": kernel}, 2)


@pytest.mark.parametrize("kernel", ["sdpa", "reference"])
@given(data=st.data())
def test_four_ranks_match_the_oracle(workers4: Workers, kernel: str, data: st.DataObject) -> None:
    _run_each_communicator(workers4, {**data.draw(communicator_cases(4)), "kernel": kernel}, 4)


@settings(max_examples=12)
@given(data=st.data())
def test_two_ranks_with_sinks_and_softcap_match_the_oracle(
    workers2: Workers, data: st.DataObject
) -> None:
    """Every communicator, with attention sinks and a logit cap (each in half the problems):
    exact, its gradient too, and the same bytes as without them (the sinks move nothing)."""
    case = data.draw(communicator_cases(2, sinks=True, softcap=True))
    _run_each_communicator(workers2, {**case, "kernel": "reference"}, 2)


@settings(max_examples=8)
@given(data=st.data())
def test_four_ranks_with_sinks_and_softcap_match_the_oracle(
    workers4: Workers, data: st.DataObject
) -> None:
    case = data.draw(communicator_cases(4, sinks=True, softcap=True))
    _run_each_communicator(workers4, {**case, "kernel": "reference"}, 4)


def test_ranks_that_disagree_on_sinks_or_softcap_raise_on_every_rank(workers2: Workers) -> None:
    messages = workers2.results("mismatched_features", {})
    assert all("softcap: rank 0 None, rank 1 2.0" in m for m in messages), messages
    assert all("sinks: rank 0 None, rank 1 tensor (2,) torch.float32" in m for m in messages)


@settings(max_examples=25)
@given(data=st.data())
def test_auto_matches_the_oracle(workers4: Workers, data: st.DataObject) -> None:
    """Whatever the cost model chooses is exact, and never sends below the minimum."""
    case = {**data.draw(communicator_cases(4)), "kernel": "sdpa", "communicator": "auto"}
    _run_and_check(workers4, case, 4)


@pytest.mark.parametrize(
    ("segments", "rates", "causal", "local"),
    [
        ([4, 8], [1, 2], False, True),  # segments tile each shard of 16: nothing moves
        ([16], [4], True, True),  # one segment per shard exactly
        ([32], [2], False, False),  # one segment spans both shards
        ([6, 12], [1, 3], True, False),  # misaligned with the shard boundary
    ],
)
def test_segment_and_shard_alignments(workers2: Workers, segments, rates, causal, local) -> None:
    case = {
        "seed": 5,
        "batch": 1,
        "seq_len": 32,
        "heads": 2,
        "kv_heads": 2,
        "head_dim": 4,
        "dtype": "float64",
        "segments": segments,
        "rates": rates,
        "mode": "head_groups",
        "causal": causal,
        "scale": None,
        "communicator": "ringpass",
        "kernel": "sdpa",
    }
    results = workers2.results("sharded_case", case)
    _check(case, results, 2)
    sent = [r["forward_bytes_sent"] for r in results]
    assert (sum(sent) == 0) == local
    if causal:
        assert sent[-1] == 0, "under causal the last rank sends nothing"


@pytest.mark.parametrize(
    ("segments", "rates", "window", "causal", "extra"),
    [
        ([40], [1], (3, None), True, {}),  # a sliding-window layer: the next rank's 3 keys
        ([40], [1], (4, 6), False, {"shard_lengths": [7, 13, 9, 11]}),  # both ways, uneven
        ([20, 40], [2, 4], (9, None), False, {"cu_seqlens": [0, 17, 40]}),  # dilated, documents
        ([40, 10], [1, 2], (0, 0), False, {"valid_runs": [[2, 37], [0, 30]]}),  # itself only
    ],
)
def test_sliding_windows_send_the_minimum_through_every_communicator(
    workers4: Workers, segments, rates, window, causal, extra
) -> None:
    """Fixed windows on 4 ranks of 40 positions (a causal sliding-window layer, a two-sided
    band on uneven shards, dilated patterns over documents, a window of the query alone over
    padded rows): every communicator exact against the oracle, forward and gradients, and each
    rank's bytes those of :func:`_expected_bytes` (the pairs some query of another rank sees,
    from the oracle's mask): a window that reaches less sends less."""
    case = {
        "seed": 9, "batch": 2, "seq_len": 40, "heads": 4, "kv_heads": 2, "head_dim": 4,
        "dtype": "float64", "segments": segments, "rates": rates, "mode": "head_groups",
        "causal": causal, "window": window, "scale": None, "kernel": "sdpa", **extra,
    }  # fmt: skip
    _run_each_communicator(workers4, case, 4)
    if window == (0, 0):  # every query sees itself only: nothing crosses
        results = workers4.results("sharded_case", {**case, "communicator": "ringpass"})
        assert [r["forward_bytes_sent"] for r in results] == [0, 0, 0, 0]


def test_bad_input_on_one_rank_raises_on_every_rank(workers4: Workers) -> None:
    start = time.monotonic()
    messages = workers4.results("bad_input_on_one_rank", {"bad_rank": 2})
    assert time.monotonic() - start < 10
    assert messages[2] == "k and v head_dim must equal q's 8, got 4"
    for rank in (0, 1, 3):
        assert messages[rank].startswith(
            "rank 2 rejected its input, so every rank stops: ValueError:"
        )


def test_disagreeing_ranks_raise_on_every_rank(workers2: Workers) -> None:
    messages = workers2.results("mismatched_config", {})
    assert all(
        "ranks disagree on the call" in m and "causal: rank 0 False, rank 1 True" in m
        for m in messages
    )


def test_a_dead_rank_makes_the_others_raise_within_the_timeout() -> None:
    pool = Workers(2, timeout_s=5, tasks=TASKS)
    try:
        for inbox in pool._inboxes:
            inbox.put((f"{TASKS}:rank_dies", {}))
        rank, ok, message = pool._outbox.get(timeout=60)
        assert rank == 0 and ok
        assert message.startswith("raised "), message
        assert float(message.rsplit(" ", 1)[1].rstrip("s")) < 30
    finally:
        pool.close()


def test_module_on_shards(workers2: Workers) -> None:
    results = workers2.results("module_on_shards", {})
    assert all(r["equal"] for r in results)
    # After a call, explain() shows what each communicator moves for its shards. Heads 2 and 3
    # (segment 32, rate 4) select 4 positions per shard of 16; one position's key and value
    # weigh 2 * 8 * 8 B. Causal: rank 0 sends 2 heads x 4 positions (1 KiB) to rank 1 only;
    # allgather would also send rank 1's (padded) payload back to rank 0.
    text = results[0]["explain"]
    assert "communicator: ringpass (least modelled time that fits) for 2 rank(s)" in text
    assert "  ringpass: per rank sends 0 B to 1 KiB (the minimum), receives 0 B to 1 KiB;" in text
    assert "not chosen allgather: per rank sends 1 KiB, up to 1 KiB above the minimum" in text
    torch.manual_seed(0)
    full = torch.randn(1, 32, 4, 8, dtype=torch.float64)
    expected = oracle(full, full, full, [8, 32], [1, 4], causal=True)
    assert torch.allclose(torch.cat([r["out"] for r in results], 1), expected, atol=1e-12, rtol=0)


def test_a_module_on_a_2x2_mesh_runs_hybrid_exactly(workers4: Workers) -> None:
    results = workers4.results("module_on_a_grid", {})
    q, k, v = results[0]["full"]
    expected = oracle(q, k, v, [8, 32], [1, 4], causal=True)
    assert max_error(torch.cat([r["out"] for r in results], 1), expected) < 1e-12
    for r in results:
        assert "communicator: hybrid (highest priority that fits) for 4 rank(s)" in r["before"]
        assert "communicator: hybrid (least modelled time that fits) for 4 rank(s)" in r["after"]
        assert "rejected ringpass: runs on a process group, the call has a 2-D" in r["after"]


@pytest.mark.parametrize("communicator", ["ringpass", "ulysses"])
def test_a_loss_using_lse_on_one_rank_only_has_exact_gradients(
    workers2: Workers, communicator: str
) -> None:
    """One rank's dlse is None, the other's a tensor: the ranks still exchange alike (ulysses
    sends zeros for None), and the gradients are those of the sum of both ranks' losses."""
    results = workers2.results("lse_loss_on_one_rank", {"communicator": communicator})
    r0 = results[0]
    q, k, v = (x.clone().requires_grad_() for x in r0["full"])
    out, lse = oracle(q, k, v, [16], [2], causal=True, return_lse=True)
    dlse = r0["dlse"].clone()
    dlse[:, :, 8:] = 0  # rank 1's positions: its loss has no lse term

    def loss(o: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (o * r0["dout"]).sum() + (s.masked_fill(torch.isneginf(s), 0) * dlse).sum()

    expected = torch.autograd.grad(loss(out, lse), (q, k, v))
    # The returned lse is float32: its gradient's rounding is the baseline's too.
    base_out, _ = dense_attention(q, k, v, [16], [2], causal=True)
    _, base_lse = dense_attention(q, k, v, [16], [2], causal=True, dtype=torch.float32)
    baseline = torch.autograd.grad(loss(base_out, base_lse.double()), (q, k, v))
    for name, i in (("dq", 0), ("dk", 1), ("dv", 2)):
        got = torch.cat([r["grads"][i] for r in results], 1)
        assert_within_tolerance(got, expected[i], baseline[i], what=name)


@pytest.mark.parametrize("communicator", ["ringpass", "ulysses"])
def test_dropout_gives_every_head_its_own_masks(workers2: Workers, communicator: str) -> None:
    results = workers2.results("dropout_on_equal_heads", {"communicator": communicator})
    assert all(r["heads_differ"] for r in results), results


@pytest.mark.parametrize("communicator", ["ulysses", "hybrid"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_with_odd_sizes(workers2: Workers, communicator: str, dtype: str) -> None:
    """Out (2-byte) and lse (4-byte) travel in one byte buffer: with an odd number of half
    values before it, the lse must still land aligned. Shards of 3 and 4, head dim 3."""
    case = {
        "seed": 3, "batch": 1, "seq_len": 7, "shard_lengths": [3, 4], "heads": 2,
        "kv_heads": 1, "head_dim": 3, "dtype": dtype, "segments": [4, 7], "rates": [1, 2],
        "mode": "head_groups", "causal": True, "scale": None, "communicator": communicator,
        "kernel": "reference",
    }  # fmt: skip
    _run_and_check(workers2, case, 2)


def test_rotary_positions_follow_uneven_shards(workers4: Workers) -> None:
    """Each rank's rotary positions start where its shard starts, whatever the lengths."""
    results = workers4.results("rotary_module_on_uneven_shards", {"lengths": [3, 13, 9, 7]})
    assert [r["out"].shape[1] for r in results] == [3, 13, 9, 7]
    for r in results:
        assert max_error(r["out"], r["expected"]) < 1e-12


def _aligned_case(world: int, **overrides: Any) -> dict[str, Any]:
    case = {
        "seed": 11,
        "batch": 2,
        "seq_len": 8 * world,
        "heads": 4,
        "kv_heads": 2,
        "head_dim": 4,
        "dtype": "float64",
        "segments": [4, 8 * world],
        "rates": [1, 2],
        "mode": "head_groups",
        "causal": False,
        "scale": None,
        "communicator": "allgather",
        "kernel": "sdpa",
    }
    return {**case, **overrides}


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_allgather_is_exact_where_it_fits(workers2: Workers, workers4: Workers, mode: str) -> None:
    for world, pool in ((2, workers2), (4, workers4)):
        case = _aligned_case(world, mode=mode)
        _check(case, pool.results("sharded_case", case), world)


@pytest.mark.parametrize(
    "overrides",
    [
        {"causal": True},  # earlier ranks receive pieces they ignore
        {"segments": [6, 16], "rates": [1, 1], "seq_len": 16},  # pieces of uneven size
        {"segments": [12], "rates": [1]},  # overlapping segment groups, narrower than 4 ranks
        {"segments": [12], "rates": [2], "causal": True, "shard_lengths": [3, 9, 13, 7]},
    ],
)
def test_allgather_serves_what_it_used_to_decline(
    workers4: Workers, overrides: dict[str, Any]
) -> None:
    """Causal calls, uneven pieces and overlapping segment groups: exact against the oracle,
    with the bytes of one broadcast payload per rank, padded to the largest (checked in
    ``_check`` against a count from the oracle's mask)."""
    case = _aligned_case(4, **overrides)
    if "shard_lengths" in case:
        case["seq_len"] = sum(case["shard_lengths"])
    _check(case, workers4.results("sharded_case", case), 4)


@pytest.mark.parametrize(("mode", "causal"), [("head_groups", False), ("longnet", True)])
def test_dropout_across_ranks_has_exact_gradients(
    workers2: Workers, mode: str, causal: bool
) -> None:
    results = workers2.results("dropout_directional_derivative", {"mode": mode, "causal": causal})
    for r in results:
        assert r["analytic"] == pytest.approx(r["numeric"], rel=1e-6, abs=1e-8)
        # Each rank's own gradients, not just the all-reduced total, are right.
        assert r["own_analytic"] == pytest.approx(r["own_numeric"], rel=1e-6, abs=1e-8)
