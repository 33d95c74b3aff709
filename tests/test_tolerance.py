"""The tolerance rule itself (docs/spec.md, section 4): it must be able to fail."""

from __future__ import annotations

import pytest
import torch

from ringdilated.testing import allowed_error, assert_within_tolerance


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
