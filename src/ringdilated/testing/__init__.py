"""Testing helpers for ringdilated and its plugin authors: the float64 oracle, SPEC.md's
tolerance rule and the kernel conformance kit."""

from ringdilated.testing._oracle import dense_attention, oracle, pattern_weights
from ringdilated.testing._tolerance import FLOORS, assert_within_tolerance, max_error
from ringdilated.testing.conformance import (
    CHECKS,
    ConformanceError,
    ConformanceReport,
    check_kernel,
    kernel_cases,
)

__all__ = [
    "CHECKS",
    "FLOORS",
    "ConformanceError",
    "ConformanceReport",
    "assert_within_tolerance",
    "check_kernel",
    "dense_attention",
    "kernel_cases",
    "max_error",
    "oracle",
    "pattern_weights",
]
