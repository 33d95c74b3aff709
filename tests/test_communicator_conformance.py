"""The communicator conformance kit: the built-in communicators pass on 2 and 4 gloo ranks, and
a communicator that corrupts what it moves is rejected for it."""

from __future__ import annotations

import pytest

from ringdilated.pool import Workers
from ringdilated.testing import ConformanceError, check_communicator


@pytest.mark.parametrize("name", ["ringpass", "allgather", "local"])
def test_builtin_communicators_match_local(name: str, workers2: Workers, workers4: Workers) -> None:
    if name == "local":
        with pytest.raises(ConformanceError, match="declined every problem"):
            check_communicator(name, pools={2: workers2}, world_sizes=(2,), max_examples=5)
        return
    report = check_communicator(name, pools={2: workers2, 4: workers4}, max_examples=10)
    assert report.world_sizes == (2, 4) and all(n > 0 for n in report.problems)


def test_a_corrupting_communicator_is_rejected(workers2: Workers) -> None:
    workers2.results("tests.corrupt_plugin:install", {})
    try:
        with pytest.raises(
            ConformanceError, match=r"\[matches-local\] (out|lse|dq|dk|dv): sharded"
        ):
            check_communicator("corrupting", pools={2: workers2}, world_sizes=(2,), max_examples=10)
    finally:
        workers2.results("tests.corrupt_plugin:uninstall", {})
