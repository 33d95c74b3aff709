"""The tolerance rule itself (docs/spec.md, section 4): it must be able to fail."""

from __future__ import annotations

import pytest
import torch

from ringdilated.testing import (
    allowed_error,
    assert_non_finite_rule,
    assert_within_tolerance,
    nan_allowed,
)


def _expected() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


def test_a_result_within_twice_the_baseline_error_passes_and_one_beyond_fails() -> None:
    expected = _expected()
    baseline = expected.float()
    assert_within_tolerance(expected.float(), expected, baseline)
    wrong = expected.float().clone()
    wrong[0, 0] += 1e-3
    with pytest.raises(AssertionError, match=r"max error 1\.000e-03"):
        assert_within_tolerance(wrong, expected, baseline)


def test_a_nan_result_fails() -> None:
    expected = _expected()
    with pytest.raises(AssertionError, match="max error inf"):
        assert_within_tolerance(torch.full_like(expected, float("nan")), expected, expected)


def test_nan_and_inf_where_the_oracle_has_them_pass_and_elsewhere_fail() -> None:
    """Non-finite inputs: the result must hold NaN and infinity exactly where the oracle does."""
    expected = _expected()
    expected[0, 3], expected[2, 1] = float("nan"), float("inf")
    assert_within_tolerance(expected.float(), expected, expected.float())
    for wrong_place in ((0, 2), (1, 1)):
        moved = expected.float().clone()
        moved[wrong_place] = float("nan")
        with pytest.raises(AssertionError):
            assert_within_tolerance(moved, expected, expected.float())
    finite = expected.float().nan_to_num(0.0, 1.0)
    with pytest.raises(AssertionError):
        assert_within_tolerance(finite, expected, expected.float())


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_a_baseline_that_is_not_finite_where_the_oracle_is_cannot_allow_everything(
    bad: float,
) -> None:
    """Otherwise the allowance is infinite and even an all-NaN result passes."""
    expected = _expected()
    baseline = expected.float().clone()
    baseline[0, 0] = bad
    with pytest.raises(ValueError, match="baseline's NaN or infinite entries differ"):
        allowed_error(expected, baseline, torch.float32)
    with pytest.raises(ValueError, match="cannot judge this case"):
        assert_within_tolerance(torch.full_like(baseline, float("nan")), expected, baseline)


def test_neg_inf_entries_must_coincide() -> None:
    expected = _expected()
    expected[1, 2] = float("-inf")
    assert_within_tolerance(expected.float(), expected, expected.float())
    moved = expected.float().clone()
    moved[1, 2], moved[1, 3] = 0.0, float("-inf")
    with pytest.raises(AssertionError):
        assert_within_tolerance(moved, expected, expected.float())


# The non-finite rule -----------------------------------------------------------------------------


def test_non_finite_rule_needs_non_finite_where_the_oracle_is() -> None:
    """(a): NaN or infinity in the exact result must stay non-finite (any kind will do)."""
    expected = _expected()
    expected[0, 3], expected[2, 1], expected[3, 0] = float("nan"), float("inf"), float("-inf")
    nowhere = torch.zeros((), dtype=torch.bool)
    assert_non_finite_rule(expected.float(), expected, expected.float(), nowhere)
    as_nan = expected.float().nan_to_num(float("nan"), float("nan"), float("nan"))
    as_nan[torch.isinf(expected)] = float("nan")
    assert_non_finite_rule(as_nan, expected, expected.float(), nowhere)
    with pytest.raises(AssertionError, match="turned into finite numbers"):
        assert_non_finite_rule(
            expected.float().nan_to_num(0.0, 1.0, -1.0), expected, expected.float(), nowhere
        )


def test_non_finite_rule_allows_nan_only_where_told_and_judges_the_rest() -> None:
    """(b): finite entries of the exact result are within tolerance, or NaN where allowed."""
    expected = _expected()
    expected[0, 3] = float("nan")
    baseline = expected.float()
    row0 = torch.tensor([True, False, False, False]).unsqueeze(-1)  # row 0 shares the NaN
    spread = expected.float().clone()
    spread[0] = float("nan")
    assert_non_finite_rule(spread, expected, baseline, row0)
    spread[1, 0] = float("nan")
    with pytest.raises(AssertionError, match="reached outputs it must not"):
        assert_non_finite_rule(spread, expected, baseline, row0)
    inf_there = expected.float().clone()
    inf_there[0, 0] = float("inf")  # allowed rows may be NaN, never infinite
    with pytest.raises(AssertionError, match="reached outputs it must not"):
        assert_non_finite_rule(inf_there, expected, baseline, row0)
    wrong = expected.float().clone()
    wrong[2, 2] += 1e-3
    with pytest.raises(AssertionError, match=r"max error 1\.000e-03"):
        assert_non_finite_rule(wrong, expected, baseline, row0)


def test_nan_allowed_follows_segments_selection_heads_and_modes() -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, 4, 2, generator=g) for _ in range(3))
    k[1, 5, 1, 0] = float("nan")  # batch row 1, key/value head 1, position 5
    pattern = ([4, 8], [1, 2])  # head_groups: heads 0, 1 use (4, 1); heads 2, 3 use (8, 2)
    may = nan_allowed(q, k, v, *pattern)
    expected = torch.zeros(2, 16, 4, dtype=torch.bool)
    expected[1, 4:8, 1] = True  # head 1: segment [4, 8) of w=4, every position selected
    assert torch.equal(may, expected)
    k[1, 5, 1, 0] = 0.0
    k[1, 9, 3, 0] = float("inf")  # head 3: w=8, r=2, offset 1 selects odd positions
    may = nan_allowed(q, k, v, *pattern)
    expected = torch.zeros(2, 16, 4, dtype=torch.bool)
    expected[1, 9:16:2, 3] = True
    assert torch.equal(may, expected)
    q[0, 2, 0, 1] = float("nan")
    assert bool(nan_allowed(q, k, v, *pattern)[0, 2, 0]), "a non-finite query's own row"
    longnet = nan_allowed(q, k, v, *pattern, mode="longnet")
    # longnet: every pattern of the head counts, each where it selects: (4, 1) at offset 0
    # covers [8, 12); (8, 2) at head 3's offset (3 * 2) // 4 = 1 the odd positions of [8, 16).
    assert longnet[1, :, 3].nonzero().flatten().tolist() == [8, 9, 10, 11, 13, 15]
    assert not bool(longnet[1, :, :3].any())
    documents = nan_allowed(q, k, v, *pattern, cu_seqlens=torch.tensor([0, 6, 16]))
    # position 9 is 3 into the document [6, 16): its segment is [6, 14), odd offsets selected
    assert documents[1, :, 3].nonzero().flatten().tolist() == [7, 9, 11, 13]


def test_the_oracle_keeps_finite_the_value_gradient_of_a_key_no_bad_row_sees() -> None:
    """A review found the oracle's value gradient NaN at a key hidden from the only row whose
    ``dout`` was NaN (autograd multiplied its zero probability by the NaN); the exact gradient is
    that of the rows that see the key, finite."""
    from ringdilated.testing import oracle

    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, 8, 1, 4, generator=g, dtype=torch.float64).requires_grad_() for _ in "qkv"
    )
    out = oracle(q, k, v, [8], [1], causal=True)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dout[0, 2] = float("nan")  # row 2 sees keys 0-2 only
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    assert dv[0, :3].isnan().all() and torch.isfinite(dv[0, 3:]).all()
    assert dk[0, :3].isnan().all() and torch.isfinite(dk[0, 3:]).all()
    assert dq[0, 2].isnan().all() and torch.isfinite(dq[0, [0, 1, 3, 4, 5, 6, 7]]).all()
