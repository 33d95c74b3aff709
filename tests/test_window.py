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
from ringdilated.core.contract.causal import bottom_right_pieces
from ringdilated.core.contract.communicator import mask_argument
from ringdilated.core.plan.shards import payload, shard_plan
from ringdilated.core.plan.window import as_window
from ringdilated.core.run.limited import RowChunk, row_chunks

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
    # By rank order alone: a left bound of 0 hides every earlier key, a right bound of 0 every
    # later one; how far a positive bound reaches is the pieces' question (Crossing.sent).
    assert not KeyWindow(0, None).sends(0, 1) and KeyWindow(0, None).sends(1, 0)
    assert KeyWindow(3, 0).sends(0, 1) and not KeyWindow(3, 0).sends(1, 0)
    assert KeyWindow(3, 2).sends(0, 1) and KeyWindow(3, 2).sends(1, 0)


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


# -- a left bound (issue 24) ----------------------------------------------------------------------

LEFT_WINDOWS = [
    KeyWindow(left, right)
    for left in (None, -4, -1, 0, 1, 3, 9)
    for right in (None, -5, -1, 0, 2, 8)
]


@pytest.mark.parametrize("window", LEFT_WINDOWS, ids=str)
def test_visible_rows_and_keys_match_the_dense_definition(window: KeyWindow) -> None:
    """For every block shape up to 7 x 7 and every run of rows: the rows that see a key are
    exactly ``visible_rows``, the keys a run sees exactly ``visible_keys`` (one contiguous run),
    ``sees_any`` whether there is any pair, and ``mark_empty_rows`` marks exactly the others."""
    for q_len, k_len in itertools.product(range(8), range(8)):
        pairs = {(i, j) for i in range(q_len) for j in range(k_len) if _visible(window, i, j)}
        start, stop = window.visible_rows(q_len, k_len)
        assert set(range(start, stop)) == {i for i, _ in pairs}, (q_len, k_len)
        assert window.sees_any(q_len, k_len) == bool(pairs)
        for a, b in itertools.combinations(range(q_len + 1), 2):
            first, last = window.visible_keys(a, b, k_len)
            assert set(range(first, last)) == {j for i, j in pairs if a <= i < b}, (a, b)
        out, lse = torch.ones(1, 1, q_len, 2), torch.zeros(1, 1, q_len)
        BlockOptions(1.0, window).mark_empty_rows(out, lse, k_len)
        empty = [i for i in range(q_len) if not any(p[0] == i for p in pairs)]
        assert torch.isneginf(lse[0, 0]).nonzero().flatten().tolist() == empty
        assert (out[0, 0].sum(-1) == 0).nonzero().flatten().tolist() == empty


def test_marking_empty_rows_under_a_left_bound_needs_the_keys() -> None:
    with pytest.raises(ValueError, match="needs k_len"):
        BlockOptions(1.0, KeyWindow(2, 0)).mark_empty_rows(None, torch.zeros(1, 1, 4))


@pytest.mark.parametrize("window", LEFT_WINDOWS, ids=str)
def test_bottom_right_pieces_reproduce_any_window(window: KeyWindow) -> None:
    """Each piece read as flash-attn reads ``window_size`` (bottom-right aligned: ``j <= i + d``
    when causal, ``j >= i + d - left``, ``d`` its keys less its rows), over its rows and keys:
    together they show exactly the window's pairs, each row in one piece, no row of a piece
    without a key, every ``left`` of a piece ``>= 0``."""
    for q_len, k_len in itertools.product(range(7), range(7)):
        shown: set[tuple[int, int]] = set()
        rows: list[int] = []
        for p in bottom_right_pieces(q_len, k_len, window):
            assert p.left is None or p.left >= 0
            d = p.key_count - p.rows
            for i in range(p.rows):
                seen = {
                    (p.row_start + i, p.key_start + j)
                    for j in range(p.key_count)
                    if (not p.causal or j <= i + d) and (p.left is None or j >= i + d - p.left)
                }
                assert seen, (p, i)
                shown |= seen
                rows.append(p.row_start + i)
        expected = {(i, j) for i in range(q_len) for j in range(k_len) if _visible(window, i, j)}
        assert shown == expected, (q_len, k_len)
        assert len(rows) == len(set(rows))


def test_pieces_without_a_left_bound_are_0_1_pieces() -> None:
    """No left bound: keys from 0 and no ``left``, as before (kernels of 0.1 keep working)."""
    for offset in (None, -3, 0, 2, 9):
        for p in bottom_right_pieces(5, 7, offset):
            assert (p.key_start, p.left) == (0, None)
        assert bottom_right_pieces(5, 7, offset) == bottom_right_pieces(
            5, 7, KeyWindow(None, offset)
        )


def test_forward_by_piece_narrows_keys_and_marks_trailing_rows() -> None:
    """Dense bottom-right math as the native call: under a band each piece gets only the keys
    from its first row's first, and rows past the band's reach come back ``out = 0``,
    ``lse = -inf``; the result is the window's dense attention."""
    from ringdilated.core import forward_by_piece
    from ringdilated.testing.kernel_cases import dense

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, n, 4, generator=g, dtype=torch.float64) for n in (9, 7, 7))
    window = KeyWindow(-1, 3)  # keys 1 to 3 ahead of the row: rows 6 to 8 see none
    handed = []

    def native(q, k, v, piece):  # type: ignore[no-untyped-def]
        handed.append((piece.key_start, k.shape[-2]))
        d = piece.key_count - piece.rows
        i = torch.arange(piece.rows).unsqueeze(1)
        j = torch.arange(piece.key_count)
        seen = torch.ones(piece.rows, piece.key_count, dtype=torch.bool)
        if piece.causal:
            seen &= j <= i + d
        if piece.left is not None:
            seen &= j >= i + d - piece.left
        from ringdilated.testing import masked_attention

        return masked_attention(q, k, v, seen, 0.5, torch.float64)

    out, lse = forward_by_piece(native, q, k, v, window)
    expected, expected_lse = dense(q, k, v, 0.5, window)
    assert torch.allclose(out, expected, atol=1e-14)
    assert torch.equal(lse.isneginf(), expected_lse.isneginf())
    assert lse[..., 6:].isneginf().all() and (out[..., 6:, :] == 0).all()
    assert all(start > 0 for start, _ in handed[1:]) or len(handed) == 1


@pytest.mark.parametrize("window", [KeyWindow(2, 0), KeyWindow(0, 3), KeyWindow(-1, 4)], ids=str)
def test_a_nan_lse_reaches_exactly_the_keys_its_row_sees(window: KeyWindow) -> None:
    """:func:`mark_non_finite_problems` under a left bound: a merged lse of NaN in one row makes
    NaN that row's ``dq`` and the ``dk``, ``dv`` of exactly the keys it sees, nothing else of
    the problem (counts of NaN rows, not sums, so NaN rows before the run stay out)."""
    from ringdilated.core.contract.kernel import mark_non_finite_problems

    q_len, k_len = 6, 8
    for row in range(q_len):
        lse = torch.zeros(1, 1, q_len)
        lse[0, 0, row] = float("nan")
        grads = [
            torch.zeros(1, 1, q_len, 2),
            torch.zeros(1, 1, k_len, 2),
            torch.zeros(1, 1, k_len, 2),
        ]
        inputs = [torch.zeros(1, 1, n, 2) for n in (q_len, k_len, k_len)]
        mark_non_finite_problems(
            *grads, torch.zeros(1, 1, q_len, 2), *inputs, lse,
            forward_marked=True, options=BlockOptions(1.0, window),
        )  # fmt: skip
        seen = {j for j in range(k_len) if _visible(window, row, j)}
        assert grads[0][0, 0, :, 0].isnan().nonzero().flatten().tolist() == [row]
        for g in grads[1:]:
            assert set(g[0, 0, :, 0].isnan().nonzero().flatten().tolist()) == seen, row


def test_row_chunks_hold_the_keys_their_rows_see() -> None:
    """Worked by hand: 1000 rows, 1200 keys, window ``(10, 2)`` (width 13): bands of 256 rows
    (``4 x (256 + 13) <= 1200``), band ``[256, 512)`` seeing keys ``[246, 514)``, its window
    shifted to its first row and first key: ``(10, 2 + 10)``; a causal window's budget chunks
    see the keys up to their last row; a chunk whose rows see nothing has no keys; without
    bands, one chunk of the keys any row sees."""
    options = BlockOptions(0.5, KeyWindow(10, 2))
    chunks = list(row_chunks(1000, 1, None, options, 1200))
    assert [(c.start, c.stop) for c in chunks] == [(0, 256), (256, 512), (512, 768), (768, 1000)]
    assert (chunks[1].key_start, chunks[1].key_stop) == (246, 514)
    assert chunks[1].options.window == KeyWindow(0, 12)
    assert (chunks[0].key_start, chunks[0].key_stop) == (0, 258)
    # Without bands (a kernel skipping hidden keys): one chunk, the keys any row sees.
    unbanded = list(row_chunks(1000, 1, None, options, 1200, bands=False))
    assert unbanded == [RowChunk(0, 1000, options, 0, 1002)]
    causal = list(row_chunks(8, 1, 3, BlockOptions(0.5, CAUSAL), 8))
    assert [(c.key_start, c.key_stop) for c in causal] == [(0, 3), (0, 6), (0, None)]
    hidden = list(row_chunks(4, 1, 2, BlockOptions(0.5, KeyWindow(-6, None)), 8))
    assert [c.sees_keys for c in hidden] == [True, False]
