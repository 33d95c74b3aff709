"""Testing helpers for ringdilated and its plugin authors: the float64 oracle, the tolerance
rule (docs/spec.md, section 4), and the conformance kits for kernels and communicators.

The oracle and the tolerance rule need only torch. The conformance kits (``check_kernel``,
``check_communicator`` and friends) need hypothesis, installed with the test extra
(``pip install -e '.[test]'`` in a clone of ringdilated); they are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from ringdilated.testing._oracle import (
    dense_attention,
    masked_attention,
    nan_allowed,
    oracle,
    pattern_weights,
)
from ringdilated.testing._tolerance import (
    FLOORS,
    allowed_error,
    assert_non_finite_rule,
    assert_within_tolerance,
    max_error,
    non_finite_violation,
    tolerance_floor,
)

_KIT = {
    "CHECKS": "conformance",
    "ConformanceError": "conformance",
    "ConformanceReport": "conformance",
    "applicable_checks": "conformance",
    "check_kernel": "conformance",
    "kernel_cases": "conformance",
    "COMMUNICATOR_CHECKS": "communicators",
    "CommunicatorReport": "communicators",
    "check_communicator": "communicators",
}

__all__ = [
    "CHECKS",
    "COMMUNICATOR_CHECKS",
    "FLOORS",
    "CommunicatorReport",
    "ConformanceError",
    "ConformanceReport",
    "allowed_error",
    "applicable_checks",
    "assert_non_finite_rule",
    "assert_within_tolerance",
    "check_communicator",
    "check_kernel",
    "dense_attention",
    "kernel_cases",
    "masked_attention",
    "max_error",
    "nan_allowed",
    "non_finite_violation",
    "oracle",
    "pattern_weights",
    "tolerance_floor",
]


def __getattr__(name: str) -> Any:
    if name in _KIT:
        try:
            kit = importlib.import_module(f"ringdilated.testing.{_KIT[name]}")
        except ModuleNotFoundError as exc:
            raise ImportError(
                f"ringdilated.testing.{name} is the conformance kit, which needs {exc.name!r}: "
                "pip install -e '.[test]' (in the ringdilated clone)"
            ) from exc
        return getattr(kit, name)
    raise AttributeError(f"module 'ringdilated.testing' has no attribute {name!r}")
