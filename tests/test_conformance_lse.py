"""The kit's check of the contract's optional ``backward_with_lse`` (inside ``gradients``): the
driver's own fallback (two ``backward`` calls, :func:`backward_plus_lse_gradient`) passes it,
empty rows included; a ``backward_with_lse`` that ignores ``dlse`` or scales it wrongly fails.
FlashAttention 4's runs through its stand-in in tests/test_flash3_flash4.py."""

from __future__ import annotations

import pytest

from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.core import KernelSpec
from ringdilated.core.contract.lse import backward_plus_lse_gradient
from ringdilated.testing import ConformanceError, check_kernel


class FallbackWithLse(ReferenceKernel):
    """``backward_with_lse`` as the driver computes it for a kernel without one."""

    factor = 1.0

    def backward_with_lse(self, dout, dlse, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        return backward_plus_lse_gradient(
            ReferenceKernel(), dout, dlse * self.factor, q, k, v, out, lse, options
        )


class IgnoresDlse(FallbackWithLse):
    factor = 0.0


class DoublesDlse(FallbackWithLse):
    factor = 2.0


def _spec(kernel: type) -> KernelSpec:
    return KernelSpec(
        name=kernel.__name__, factory=kernel, capabilities=REFERENCE_SPEC.capabilities
    )


def test_the_fallback_passes_with_dlse_on_rows_that_see_no_key() -> None:
    report = check_kernel(_spec(FallbackWithLse), max_examples=6, checks=("gradients",))
    assert report.passed == ("gradients",)


@pytest.mark.parametrize("kernel", [IgnoresDlse, DoublesDlse])
def test_a_wrong_backward_with_lse_fails(kernel: type) -> None:
    with pytest.raises(ConformanceError, match="with the lse's gradient"):
        check_kernel(_spec(kernel), max_examples=6, checks=("gradients",))
