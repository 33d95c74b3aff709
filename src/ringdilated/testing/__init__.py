"""Testing helpers for ringdilated and its plugin authors: the float64 oracle and SPEC.md's
tolerance rule."""

from ringdilated.testing._oracle import dense_attention, oracle, pattern_weights
from ringdilated.testing._tolerance import FLOORS, assert_within_tolerance, max_error

__all__ = [
    "FLOORS",
    "assert_within_tolerance",
    "dense_attention",
    "max_error",
    "oracle",
    "pattern_weights",
]
