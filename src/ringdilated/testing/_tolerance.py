"""The tolerance rule (docs/spec.md, section 4 "Numerics"): the one place it is written.

A result in dtype ``T`` passes when its largest error against the float64 oracle is at most twice
the error of plain dense masked attention computed in ``T`` on the same inputs, plus a small
absolute floor for ``T``. Non-finite entries must match exactly: ``-inf`` (queries with no key),
and NaN and infinity where the inputs hold them (docs/spec.md, section 4).

The floor is ``FLOORS[T] * max(1, max |oracle|)``: about one unit in the last place of ``T`` at the
result's own magnitude (a result stored in ``T`` cannot be closer than its final rounding, and on
tiny inputs the dense baseline's error can be zero by chance). For results of magnitude at most 1
it is the absolute floor itself.

:func:`allowed_error` computes the allowance; :func:`assert_within_tolerance` applies it. The
conformance kits, the communicator kit and ``ringdilated demo`` all call :func:`allowed_error`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["FLOORS", "allowed_error", "assert_within_tolerance", "max_error", "tolerance_floor"]

FLOORS: dict[torch.dtype, float] = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 1e-3,
    torch.bfloat16: 1e-2,
}


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference over the entries where ``expected`` is finite; ``inf``
    unless NaN, ``+inf`` and ``-inf`` entries coincide exactly (same kind, same place)."""
    a, e = actual.detach().double(), expected.detach().double()
    for special in (torch.isnan, torch.isposinf, torch.isneginf):
        if not torch.equal(special(a), special(e)):
            return float("inf")
    diff = (a - e).abs().masked_fill(~torch.isfinite(e), 0.0)
    return float(diff.max()) if diff.numel() else 0.0


def tolerance_floor(expected: torch.Tensor, dtype: torch.dtype) -> float:
    """``FLOORS[dtype] * max(1, max |expected|)``, ``-inf`` entries of ``expected`` ignored."""
    if dtype not in FLOORS:
        raise ValueError(f"no tolerance floor for dtype {dtype}; known: {sorted(map(str, FLOORS))}")
    finite = expected.detach().double().masked_fill(torch.isneginf(expected), 0.0)
    magnitude = max(1.0, float(finite.abs().max())) if finite.numel() else 1.0
    return FLOORS[dtype] * magnitude


def allowed_error(
    expected: torch.Tensor,
    baselines: torch.Tensor | Sequence[torch.Tensor],
    dtype: torch.dtype,
    extra: float = 0.0,
) -> float:
    """The largest error against ``expected`` (float64) that a result in ``dtype`` may have.

    That is ``2 * max(max_error(b, expected) for b in baselines)``, plus
    ``tolerance_floor(expected, dtype)``, plus ``extra``.
    ``baselines``: one or several plain dense computations in ``dtype`` (the rule takes the least
    accurate; for a sharded result, the single-process result serves as the baseline).
    ``extra``: an allowance on top, for an error any implementation must make (the conformance
    kit's gradient checks add what the contract's own rounding of ``out`` and ``lse`` costs).
    Raises ``ValueError`` when a baseline's error is not finite (the allowance would be
    unbounded).
    """
    if isinstance(baselines, torch.Tensor):
        baselines = (baselines,)
    if not baselines:
        raise ValueError("allowed_error needs at least one baseline, got none")
    baseline_error = max(max_error(b, expected) for b in baselines)
    if not math.isfinite(baseline_error):
        # A baseline whose NaN or infinite entries differ from the oracle's would allow any
        # error at all.
        raise ValueError(
            f"the dense {dtype} baseline's NaN or infinite entries differ from the float64 "
            f"oracle's (its error is {baseline_error}), so the tolerance rule cannot judge this "
            f"case: the inputs are out of {dtype}'s range for attention, or the baseline is wrong"
        )
    allowed = 2 * baseline_error + tolerance_floor(expected, dtype) + extra
    if not math.isfinite(allowed):
        raise ValueError(f"the allowed error is not finite ({allowed}); extra={extra!r}")
    return allowed


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
    allowed = allowed_error(expected, baseline, dtype)
    if not error <= allowed:
        floor = tolerance_floor(expected, dtype)
        raise AssertionError(
            f"{what} ({dtype}): max error {error:.3e} vs float64 oracle exceeds "
            f"{allowed:.3e} (2 x dense {dtype} error + floor {floor:.1e})"
        )
