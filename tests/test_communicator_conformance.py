"""The communicator conformance kit: the built-in communicators pass on 2 and 4 gloo ranks, and
a communicator that corrupts what it moves is rejected for it; a third-party communicator
described by its spec alone (``tests.spec_plugin``) runs end to end, as its spec says, and every
communicator that runs is prepared once per planned call."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from ringdilated.pool import Workers
from ringdilated.testing import ConformanceError, check_communicator

TASKS = "tests.spec_plugin:calls"


@pytest.mark.parametrize("name", ["ringpass", "allgather", "ulysses", "hybrid"])
def test_builtin_communicator_matches_local_on_as_many_problems_as_asked(
    name: str, workers2: Workers, workers4: Workers
) -> None:
    """Any mismatch raises inside the kit; the report then shows that the communicator served
    the 10 problems asked of it on each world size (declines are rare enough for hypothesis to
    find 10 it serves), not a handful."""
    report = check_communicator(name, pools={2: workers2, 4: workers4}, max_examples=10)
    assert report.problems == (10, 10), report


def test_local_communicator_declines_every_sharded_problem(workers2: Workers) -> None:
    with pytest.raises(ConformanceError, match="'local' declined every problem drawn for 2 ranks"):
        check_communicator("local", pools={2: workers2}, world_sizes=(2,), max_examples=5)


def test_a_corrupting_communicator_is_rejected(workers2: Workers) -> None:
    workers2.results("tests.corrupt_plugin:install", {})
    try:
        with pytest.raises(
            ConformanceError, match=r"\[matches-local\] (out|lse|dq|dk|dv): sharded"
        ):
            check_communicator("corrupting", pools={2: workers2}, world_sizes=(2,), max_examples=10)
    finally:
        workers2.results("tests.corrupt_plugin:uninstall", {})


@pytest.fixture
def third_party(workers2: Workers, workers4: Workers) -> Iterator[None]:
    """``tests.spec_plugin``'s communicators, described by their specs alone, on every rank."""
    for pool in (workers2, workers4):
        pool.results("tests.spec_plugin:install", {})
    try:
        yield
    finally:
        for pool in (workers2, workers4):
            pool.results("tests.spec_plugin:uninstall", {})


def test_a_communicator_described_by_its_spec_alone_passes_the_kit(
    third_party: None, workers2: Workers, workers4: Workers
) -> None:
    """A broadcast communicator and a hybrid whose parts are named in its spec (its own
    instance raises if exchanged through): no class declares a delivery or parallelism."""
    pools = {2: workers2, 4: workers4}
    report = check_communicator("tp-broadcast", pools=pools, max_examples=5)
    assert report.problems == (5, 5), report
    report = check_communicator("tp-hybrid", pools=pools, world_sizes=(4,), max_examples=5)
    assert report.problems == (5,), report


def test_the_spec_s_delivery_decides_what_moves(third_party: None, workers2: Workers) -> None:
    """Causal, rank 1 needs nothing from rank 0's later queries: a broadcast delivery still
    sends it rank 1's payload, as allgather does; pairwise (ringpass) sends the minimum."""
    calls = {"calls": [(True, 1)]}
    sent = {
        name: [r["sent"][0] for r in workers2.results(TASKS, {**calls, "communicator": name})]
        for name in ("tp-broadcast", "allgather", "ringpass")
    }
    assert sent["tp-broadcast"] == sent["allgather"] != sent["ringpass"], sent


def test_every_communicator_that_runs_is_prepared_once_per_planned_call(
    third_party: None, workers2: Workers, workers4: Workers
) -> None:
    """On one SequenceLayout, a repeated call signature is planned once, a new one (causal, a
    batch of 2) again: each plan prepares what exchanges, the hybrid's two parts each on its
    own group of 2 with its ranks' plans, never the hybrid's own instance."""
    calls = [(False, 1), (False, 1), (True, 1), (True, 2)]
    payload = {"calls": calls, "communicator": "tp-hybrid"}
    for rank, result in enumerate(workers4.results(TASKS, payload)):
        assert max(result["errors"]) < 1e-12, (rank, result["errors"])
        assert result["prepared"] == [
            ("tp-ring", 2, 2, False),
            ("tp-heads", 2, 2, False),
            ("tp-ring", 2, 2, True),
            ("tp-heads", 2, 2, True),
            ("tp-ring", 2, 2, True),
            ("tp-heads", 2, 2, True),
        ], rank
    payload = {"calls": calls, "communicator": "tp-broadcast"}
    for rank, result in enumerate(workers2.results(TASKS, payload)):
        assert max(result["errors"]) < 1e-12, (rank, result["errors"])
        assert result["prepared"] == [
            ("tp-broadcast", 2, 2, False),
            ("tp-broadcast", 2, 2, True),
            ("tp-broadcast", 2, 2, True),
        ], rank
