"""The communicator conformance kit: the built-in communicators pass on 2 and 4 gloo ranks, and
a communicator that corrupts what it moves is rejected for it."""

from __future__ import annotations

import pytest

from ringdilated.pool import Workers
from ringdilated.testing import ConformanceError, check_communicator


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
