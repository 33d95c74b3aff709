"""The key window: the one value that carries a call's mask (issue 22), checked against the
dense definition ``i - left <= j <= i + right``, and its 0.1 forms (``causal_offset``, a
``causal`` parameter) kept for one release with a warning."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy
import pytest
import torch

from ringdilated.core import CAUSAL, FULL, BlockOptions, DilationPattern, KeyWindow, ShardPlan
from ringdilated.core.contract.communicator import mask_argument
from ringdilated.core.plan.shards import payload, shard_plan
from ringdilated.core.plan.window import as_window

WINDOWS = [FULL, CAUSAL, KeyWindow(None, 2), KeyWindow(None, -3), KeyWindow(1, 0), KeyWindow(2, 1)]


def _visible(window: KeyWindow, i: int, j: int) -> bool:
    left_ok = window.left is None or j >= i - window.left
    return left_ok and (window.right is None or j <= i + window.right)


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize(("q_len", "k_len"), [(1, 1), (4, 4), (3, 7), (7, 3)])
def test_block_questions_match_the_dense_definition(
    window: KeyWindow, q_len: int, k_len: int
) -> None:
    pairs = list(itertools.product(range(q_len), range(k_len)))
    assert window.needs_mask(q_len, k_len) == (not all(_visible(window, *p) for p in pairs))
    if window.left is None:  # empty rows are a prefix: what kernels mark
        empty = [i for i in range(q_len) if not any(_visible(window, i, j) for j in range(k_len))]
        expected = 0 if not empty or empty[0] != 0 else len(empty)
        assert min(window.visible_rows_start(), q_len) == min(expected, q_len)


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize(("a", "b"), [(0, 0), (5, 2), (2, 5)])
def test_shifted_is_the_window_in_block_coordinates(window: KeyWindow, a: int, b: int) -> None:
    block = window.shifted(a - b)
    for i, j in itertools.product(range(6), range(6)):
        assert _visible(block, i, j) == _visible(window, a + i, b + j), (i, j)


def test_the_send_rule_and_the_bool_shorthand() -> None:
    assert CAUSAL.hides_later_keys and KeyWindow(3, -1).hides_later_keys
    assert not FULL.hides_later_keys and not KeyWindow(None, 1).hides_later_keys
    assert as_window(True) is CAUSAL and as_window(False) is FULL and as_window(CAUSAL) is CAUSAL
    with pytest.raises(TypeError, match="KeyWindow or a bool causal flag, got 1"):
        as_window(1)  # type: ignore[arg-type]


def test_block_options_keep_causal_offset_for_one_release() -> None:
    with pytest.warns(DeprecationWarning, match="causal_offset is deprecated"):
        old = BlockOptions(0.5, causal_offset=2)
    assert old == BlockOptions(0.5, KeyWindow(None, 2))
    with pytest.warns(DeprecationWarning, match="causal_offset is deprecated"):
        positional = BlockOptions(0.5, None)
    assert positional.window == FULL
    with pytest.warns(DeprecationWarning, match="causal_offset is deprecated"):
        assert BlockOptions(0.5, CAUSAL).causal_offset == 0


def test_a_0_1_function_taking_causal_gets_the_bool_with_a_warning() -> None:
    seen: list[object] = []

    class Old:
        def prepare(self, group: object, plans: Sequence[ShardPlan], causal: bool) -> None:
            seen.append(causal)

    def new(plans: object, window: KeyWindow) -> tuple[str, ...]:
        return ()

    for window, flag in ((CAUSAL, True), (FULL, False)):
        with pytest.warns(DeprecationWarning, match="takes `causal`"):
            assert mask_argument(Old().prepare, window) is flag
    assert mask_argument(new, CAUSAL) is CAUSAL
    assert mask_argument(torch.add, CAUSAL) is CAUSAL  # no readable signature: the window


def test_the_send_rule_between_ranks() -> None:
    assert CAUSAL.sends(0, 1) and not CAUSAL.sends(1, 0)
    assert FULL.sends(0, 1) and FULL.sends(1, 0)


@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("rate", [1, 2, 3])
def test_dilated_counts_selected_keys(window: KeyWindow, rate: int) -> None:
    """Queries and keys on one grid of stride ``rate``: the window over positions, in keys."""
    keys = window.dilated(rate)
    for i, j in itertools.product(range(6), range(6)):
        assert _visible(keys, i, j) == _visible(window, rate * i, rate * j), (i, j)


def test_a_window_is_no_flag_and_holds_ints() -> None:
    with pytest.raises(TypeError, match="no causal flag"):
        bool(CAUSAL)
    for bad in ("x", 1.5, True):
        with pytest.raises(TypeError, match="bound must be an int or None"):
            KeyWindow(None, bad)  # type: ignore[arg-type]
    assert KeyWindow(numpy.int64(2), torch.tensor(0)) == KeyWindow(2, 0)  # 0.1 offsets of any int
    with pytest.raises(TypeError, match="pass one"):
        BlockOptions(0.5, CAUSAL, causal_offset=None)
    with pytest.raises(NotImplementedError, match="sliding window"):
        KeyWindow(2, 0).visible_rows_start()


def test_a_0_1_communicator_forwarding_its_bool_to_the_payloads_still_works() -> None:
    plans = [shard_plan(DilationPattern([16], [2]), 16, 2, 2, r, 2) for r in range(2)]
    for flag, window in ((True, CAUSAL), (False, FULL)):
        for src, dst in ((0, 1), (1, 0)):
            new = payload(plans[src], src, dst, window)
            assert payload(plans[src], src, dst, flag) == new
    assert payload(plans[0], 0, 1, True) and not payload(plans[1], 1, 0, True)
