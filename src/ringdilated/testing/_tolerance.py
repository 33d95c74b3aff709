"""SPEC.md section 4's tolerance rule.

A result in dtype ``T`` passes when its largest error against the float64 oracle is at most twice
the error of plain dense masked attention computed in ``T`` on the same inputs, plus a small
absolute floor for ``T``. ``-inf`` entries (queries with no key) must match exactly.

The floor is ``FLOORS[T] * max(1, max |oracle|)``: about one unit in the last place of ``T`` at the
result's own magnitude (a result stored in ``T`` cannot be closer than its final rounding, and on
tiny inputs the dense baseline's error can be zero by chance). For results of magnitude at most 1
it is the absolute floor itself.
"""

from __future__ import annotations

import torch

__all__ = ["FLOORS", "assert_within_tolerance", "max_error"]

FLOORS: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
}


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference, with ``-inf`` entries required to coincide (else ``inf``)."""
    a, e = actual.detach().double(), expected.detach().double()
    a_inf, e_inf = torch.isneginf(a), torch.isneginf(e)
    if not torch.equal(a_inf, e_inf) or bool(torch.isnan(a).any()):
        return float("inf")
    diff = (a - e).abs().masked_fill(e_inf, 0.0)
    return float(diff.max()) if diff.numel() else 0.0


def assert_within_tolerance(
    actual: torch.Tensor,
    expected: torch.Tensor,
    baseline: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    what: str = "result",
) -> None:
    """Raise ``AssertionError`` unless ``actual`` meets the rule against ``expected`` (float64).

    ``baseline`` is plain dense attention's result in ``dtype`` (default ``actual.dtype``).
    """
    dtype = dtype or actual.dtype
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{what}: shape {tuple(actual.shape)} != oracle {tuple(expected.shape)}"
        )
    error = max_error(actual, expected)
    finite = expected.detach().double().masked_fill(torch.isneginf(expected), 0.0)
    magnitude = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    floor = FLOORS[dtype] * magnitude
    allowed = 2 * max_error(baseline, expected) + floor
    if not error <= allowed:
        raise AssertionError(
            f"{what} ({dtype}): max error {error:.3e} vs float64 oracle exceeds "
            f"{allowed:.3e} (2 x dense {dtype} error + floor {floor:.1e})"
        )
