"""Kernel checks for key windows bounded on the left and softcapping, against the float64 oracle,
until the conformance kit draws such cases itself.

:func:`check_window_case` runs a kernel on one :class:`~ringdilated.testing.kernel_cases.KernelCase`
(its layout, strided views included) with a :class:`~ringdilated.core.KeyWindow` and a softcap,
and holds it to the contract: ``out`` and ``lse`` within the tolerance rule of
:func:`ringdilated.testing.masked_attention` (float64, the window in the block's top-left
coordinates, the cap on every score), rows that see no key exactly ``out = 0``, ``lse = -inf``,
and ``dq``, ``dk``, ``dv`` (the backward handed the block's own ``out`` and ``lse``, as strided
views in the case's layout) within the rule against float64 autograd, allowing on top what the
contract's rounding of ``out`` and ``lse`` costs any kernel (the fused kernels' formula,
:func:`tests.standins.math.grads`, evaluated exactly on the rounded exact ``out`` and ``lse``).
:data:`WINDOW_CASES` are the cases: windows far from the diagonal (a negative right bound, a left
bound smaller than the shift, empty windows) as a sharded run and row chunks make them.
"""

from __future__ import annotations

import random

import torch

from ringdilated.core import FULL, BlockOptions, Kernel, KeyWindow, accumulation_dtype
from ringdilated.testing import allowed_error, masked_attention, max_error
from ringdilated.testing.kernel_cases import KernelCase
from tests.standins.math import grads

__all__ = ["WINDOW_CASES", "WindowCase", "check_window_case", "top_left_window"]

WindowCase = tuple[KernelCase, KeyWindow, float | None]

#: ``(q_len, k_len)`` of the drawn cases: square, more rows, more keys, around tile sizes.
_SHAPES = ((1, 1), (1, 9), (5, 12), (12, 5), (17, 17), (20, 45), (45, 20), (33, 65), (64, 64))
_LEFTS = (None, -7, -1, 0, 1, 3, 9, 40)
_RIGHTS = (None, -12, -3, 0, 2, 6, 50)
_SOFTCAPS = (None, None, 0.7, 4.0)


def top_left_window(q_len: int, k_len: int, window: KeyWindow) -> torch.Tensor:
    """``(q_len, k_len)`` bool: key ``j`` visible to query ``i`` iff ``i - left <= j <= i +
    right`` (the kernel contract's window, written out here)."""
    rows = torch.arange(q_len).unsqueeze(1)
    cols = torch.arange(k_len).unsqueeze(0)
    visible = torch.ones(q_len, k_len, dtype=torch.bool)
    if window.right is not None:
        visible &= cols <= rows + window.right
    if window.left is not None:
        visible &= cols >= rows - window.left
    return visible


def _cases(count: int, seed: int) -> tuple[WindowCase, ...]:
    draw = random.Random(seed)
    cases = []
    for i in range(count):
        q_len, k_len = draw.choice(_SHAPES)
        kv_heads = draw.choice((1, 2))
        strided = draw.random() < 0.5
        case = KernelCase(
            n=draw.choice((1, 2)),
            heads=kv_heads * draw.choice((1, 2)),
            kv_heads=kv_heads,
            q_len=q_len,
            k_len=k_len,
            head_dim=draw.choice((16, 32, 64)),
            dtype=draw.choice((torch.float16, torch.bfloat16)),
            scale=draw.uniform(0.1, 0.6),
            window=FULL,
            seed=seed * 1000 + i,
            layout="strided" if strided else "contiguous",
            rate=draw.choice((1, 2)) if strided else 1,
            offset=draw.choice((0, 1)) if strided else 0,
        )
        window = KeyWindow(draw.choice(_LEFTS), draw.choice(_RIGHTS))
        cases.append((case, window, draw.choice(_SOFTCAPS)))
    return tuple(cases)


#: A fixed draw of cases (every shape, window and cap above, in many combinations).
WINDOW_CASES = _cases(32, seed=24)


def _blhd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


def _within(what: str, actual: torch.Tensor, expected: torch.Tensor, allowed: float) -> None:
    error = max_error(actual, expected)
    assert error <= allowed, f"{what}: max error {error:.3e} vs float64 exceeds {allowed:.3e}"


def check_window_case(
    kernel: Kernel, case: KernelCase, window: KeyWindow, softcap: float | None
) -> None:
    """Hold ``kernel`` to the contract on ``case`` under ``window`` and ``softcap`` (module
    docstring); ``AssertionError`` naming what is wrong."""
    label = f"{case} window={window} softcap={softcap}"
    q, k, v = case.tensors()
    dtype, scale = q.dtype, case.scale
    seen = top_left_window(case.q_len, case.k_len, window)
    options = BlockOptions(scale, window, softcap=softcap)
    out, lse = kernel.forward(q, k, v, options)
    assert out.shape == q.shape and out.dtype == dtype, label
    assert lse.shape == q.shape[:-1] and lse.dtype == accumulation_dtype(dtype), label
    exact_out, exact_lse = masked_attention(q, k, v, seen, scale, torch.float64, softcap=softcap)
    base_out, base_lse = masked_attention(q, k, v, seen, scale, dtype, softcap=softcap)
    _within(f"out, {label}", out, exact_out, allowed_error(exact_out, base_out, dtype))
    _within(f"lse, {label}", lse, exact_lse, allowed_error(exact_lse, base_lse, dtype))
    empty = ~seen.any(-1)
    assert bool(torch.isneginf(lse[..., empty]).all()), f"lse of rows with no key, {label}"
    assert bool((out[..., empty, :] == 0).all()), f"out of rows with no key, {label}"

    g = torch.Generator().manual_seed(case.seed + 1)
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    lay_out = case.lay_out
    actual = kernel.backward(lay_out(dout.to(dtype)), q, k, v, lay_out(out), lay_out(lse), options)
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    exact_out, exact_lse = masked_attention(*exact, seen, scale, torch.float64, softcap=softcap)
    expected = torch.autograd.grad((exact_out * dout).sum(), exact)
    base = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    base_out, _ = masked_attention(*base, seen, scale, dtype, softcap=softcap)
    baseline = torch.autograd.grad((base_out * dout.to(dtype)).sum(), base)
    stored_lse = exact_lse.detach().float().masked_fill(empty, 0.0)  # rows without keys: P = 0
    given = grads(
        _blhd(dout.to(dtype)), *map(_blhd, (q, k, v)), _blhd(exact_out.detach().to(dtype)),
        stored_lse, scale, seen, softcap=softcap,
    )  # fmt: skip
    for name, grad, exp, b, inherent in zip(
        ("dq", "dk", "dv"), actual, expected, baseline, map(_blhd, given), strict=True
    ):
        assert grad.shape == exp.shape and grad.dtype == dtype, f"{name} layout, {label}"
        allowed = allowed_error(exp, b, dtype, max_error(inherent, exp))
        _within(f"{name}, {label}", grad, exp, allowed)
