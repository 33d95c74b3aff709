"""The tolerance rule (docs/spec.md, section 4 "Numerics"): the one place it is written.

A result in dtype ``T`` passes when its largest error against the float64 oracle is at most twice
the error of plain dense masked attention computed in ``T`` on the same inputs, plus a small
absolute floor for ``T``. For finite inputs non-finite entries must match exactly (``-inf`` for
queries with no key).

NaN and infinity in the inputs (docs/spec.md, section 4; :func:`non_finite_violation`,
:func:`assert_non_finite_rule`): (a) every entry the oracle makes non-finite must be non-finite;
(b) every entry the oracle keeps finite must meet the rule above, or be NaN where the caller says
NaN may reach it (a non-finite input in the entry's own kernel block:
:func:`ringdilated.testing.nan_allowed` for a pattern, the kernel conformance kit for a block).

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

__all__ = [
    "FLOORS",
    "allowed_error",
    "assert_non_finite_rule",
    "assert_within_tolerance",
    "max_error",
    "non_finite_violation",
    "tolerance_floor",
]

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


def _masked_error(actual: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest ``|actual - expected|`` over ``mask`` (0 when empty); ``inf`` if ``actual`` is
    not finite somewhere in ``mask``."""
    a, e = actual.detach().double(), expected.detach().double()
    if not bool(torch.isfinite(a[mask]).all()):
        return float("inf")
    diff = torch.where(mask, (a - e).abs(), torch.zeros((), dtype=torch.float64))
    return float(diff.max()) if diff.numel() else 0.0


def non_finite_violation(
    actual: torch.Tensor,
    expected: torch.Tensor,
    baselines: torch.Tensor | Sequence[torch.Tensor],
    may_be_nan: torch.Tensor,
    dtype: torch.dtype,
    extra: torch.Tensor | Sequence[torch.Tensor] = (),
) -> str | None:
    """How ``actual`` breaks the non-finite rule against the float64 ``expected``, or ``None``.

    (a) Every entry ``expected`` makes non-finite (NaN, ``+inf``, ``-inf``) must be non-finite in
    ``actual`` (any of them). (b) Every entry ``expected`` keeps finite must be within
    :func:`allowed_error` of it, or NaN where ``may_be_nan`` (broadcast to ``actual``'s shape)
    allows. ``baselines`` set the allowance as in :func:`allowed_error`, over the judged entries
    (finite in ``expected``, not an allowed NaN) where the baseline itself is finite; ``extra``
    are further results whose error over the same entries is added (the kernel kit's rounding
    allowance for gradients).
    """
    if actual.shape != expected.shape:
        return f"shape {tuple(actual.shape)} != oracle {tuple(expected.shape)}"
    a, e = actual.detach().double(), expected.detach().double()
    finite = torch.isfinite(e)
    lost = finite.logical_not() & torch.isfinite(a)
    if bool(lost.any()):
        where = lost.nonzero()[0].tolist()
        return (
            f"{int(lost.sum())} entries the exact math makes non-finite are finite (first at "
            f"{where}: {float(a[tuple(where)])!r}, exact {float(e[tuple(where)])!r}): NaN or "
            "infinity was turned into finite numbers"
        )
    allowed_nan = finite & torch.isnan(a) & may_be_nan.expand(a.shape)
    judged = finite & allowed_nan.logical_not()
    stray = judged & torch.isfinite(a).logical_not()
    if bool(stray.any()):
        where = stray.nonzero()[0].tolist()
        return (
            f"{int(stray.sum())} entries the exact math keeps finite are {float(a[tuple(where)])!r}"
            f" (first at {where}, exact {float(e[tuple(where)])!r}) with no non-finite input in "
            "their kernel block: NaN or infinity reached outputs it must not"
        )
    if isinstance(baselines, torch.Tensor):
        baselines = (baselines,)
    if isinstance(extra, torch.Tensor):
        extra = (extra,)

    def judged_error(x: torch.Tensor) -> float:  # over the judged entries where x is finite
        return _masked_error(x, e, judged & torch.isfinite(x))

    base_error = max((judged_error(b) for b in baselines), default=0.0)
    masked = torch.where(judged, e, torch.zeros((), dtype=torch.float64))
    allowed = 2 * base_error + tolerance_floor(masked, dtype) + sum(map(judged_error, extra), 0.0)
    error = _masked_error(a, e, judged)
    if not error <= allowed:
        return (
            f"max error {error:.3e} vs float64 where the exact result is finite exceeds "
            f"{allowed:.3e} (2 x dense {dtype} error + floor)"
        )
    return None


def assert_non_finite_rule(
    actual: torch.Tensor,
    expected: torch.Tensor,
    baseline: torch.Tensor | Sequence[torch.Tensor],
    may_be_nan: torch.Tensor,
    *,
    dtype: torch.dtype | None = None,
    what: str = "result",
) -> None:
    """Raise ``AssertionError`` unless ``actual`` meets the non-finite rule
    (:func:`non_finite_violation`) against ``expected`` (float64): non-finite wherever the
    oracle is, and elsewhere within tolerance or NaN where ``may_be_nan``.

    ``baseline`` is plain dense attention's result in ``dtype`` (default ``actual.dtype``) on the
    same inputs; ``may_be_nan`` is, for a pattern, :func:`ringdilated.testing.nan_allowed`
    (``(B, Lq, H)``: index ``[..., None]`` for ``out``, ``.transpose(1, 2)`` for ``lse``).
    """
    problem = non_finite_violation(actual, expected, baseline, may_be_nan, dtype or actual.dtype)
    if problem is not None:
        raise AssertionError(f"{what} ({dtype or actual.dtype}): {problem}")
