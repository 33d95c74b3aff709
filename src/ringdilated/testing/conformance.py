"""The kernel conformance kit: prove a kernel backend meets the kernel contract, exactly.

    from ringdilated.testing import check_kernel
    report = check_kernel("mykernel")            # a registered name, or a KernelSpec
    report = check_kernel(spec, expected_failures={"dropout": "not implemented yet"})

Each check has an id and draws, with hypothesis, only problems the backend *declares* it
supports (device, dtypes, head dims, causal, grouped-query heads), comparing with a float64 dense
evaluation under the tolerance rule (docs/spec.md, section 4). The problems reach where real
kernels break: lengths past the 64- and 128-row tiles, every declared head dim up to 256, the
strided views the driver passes, batches above 2 (:mod:`ringdilated.testing.kernel_cases`;
``space=`` narrows them):

- ``capabilities``: every request the backend declares it serves runs (forward, and backward
  where declared) without raising and returns the contract's shapes and dtypes; requests on a
  device it does not declare are rejected with reasons;
- ``forward``: ``out`` and ``lse`` of one unmasked block;
- ``causal``: ``out`` and ``lse`` under any key window the backend declares: any right bound
  (causal offsets above, on and below the diagonal), and where ``sliding_window`` is declared,
  left bounds too (bands of any width about any diagonal, as a sliding window's row chunks and
  other ranks' pieces get them). Every other check draws these windows too (and none);
- ``empty-rows``: a query that sees no key gives ``out = 0`` and ``lse = -inf``, never NaN: the
  first rows (a right bound below them) and, where sliding windows are declared, the last rows
  (a left bound above them) and both at once; the rows that see keys match the oracle;
- ``gradients``: backward of one block with its own ``out``/``lse`` against float64 autograd;
  where the kernel has the contract's optional ``backward_with_lse``, also its gradients of
  ``sum(dout * out) + sum(dlse * lse)`` with a random ``dlse`` that is nonzero on every row,
  on the drawn window and on the ``empty-rows`` windows: a row that sees no key has the
  constant lse ``-inf``, so its ``dlse`` reaches no gradient (as in the driver's fallback);
- ``split-merge``: keys split into two blocks, merged by the accumulator, equal the whole block,
  and the two backwards with the merged ``out``/``lse`` sum to the whole gradient (the property
  rings and pattern mixing rely on);
- ``no-mutation``: inputs are never modified;
- ``non-finite``: with a NaN or an infinity placed in ``q``, ``k`` or ``v``, every entry of
  ``out`` and ``lse`` that the exact dense evaluation makes non-finite is non-finite (NaN is never
  turned into a finite number), and every other entry is within tolerance, or NaN only where its
  problem holds a non-finite input (its own query row, or any ``k``/``v`` of its ``n`` and
  key/value head: the kernel contract allows ``0 * inf`` inside a block, never across blocks);
- ``non-finite-gradients``: the same for ``dq``, ``dk``, ``dv`` with a NaN or an infinity in
  ``q``, ``k``, ``v`` or ``dout``; NaN is allowed in every gradient of a problem any of whose
  inputs is non-finite;
- ``dropout`` (where dropout is declared): the mask is the kernel's own (fused kernels draw
  theirs), so the check reads it back: forwards with one-hot values give the probability each
  value was weighed by, which must be 0 or ``P / (1 - p)`` for the exact ``P``; ``out`` and
  ``lse`` (the undropped one) match the float64 oracle under that mask; the same seed gives the
  same results, another seed another mask, about ``1 - p`` of the visible entries are kept (to
  six standard deviations and 1/256, the step of the 8-bit thresholds fused kernels use); and
  the backward, handed the forward's ``out`` and ``lse`` and the same seed, gives the oracle's
  gradients under that mask (a backward that draws another mask fails).
- ``softcap`` (where the backend declares ``Capabilities.softcap``): ``out`` and ``lse`` under
  a logit cap (``BlockOptions.softcap``, docs/spec.md, section 5), with any causal offset the
  backend declares; one case in three amplifies ``q`` so that most scores lie far past the cap,
  where ``tanh`` saturates;
- ``softcap-gradients`` (softcap and backward): the ``gradients`` and ``split-merge`` checks
  under a cap (the cap's derivative, and a capped block's share of a merged gradient);
- ``softcap-dropout`` (softcap and dropout): the ``dropout`` check under a cap.

Checks that need a feature the backend does not declare on the device (``causal``,
``empty-rows`` without causal masking or sliding windows; ``dropout`` without dropout;
``gradients``, ``split-merge``, ``non-finite-gradients`` on a forward-only target; the
``softcap`` checks without softcap) are reported as not applicable, never as passed.

A failing check raises :class:`ConformanceError` naming the check, the drawn case and the error
(the first one, where hypothesis found several).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import attrs
import torch
from hypothesis import HealthCheck, given, settings

from ringdilated.core.contract.accumulator import accumulation_dtype, merge_partials
from ringdilated.core.contract.kernel import BlockOptions, Kernel, derive_seed
from ringdilated.core.plan.window import KeyWindow
from ringdilated.core.select.capabilities import Environment, KernelSpec, Request
from ringdilated.core.support.errors import ConformanceError
from ringdilated.testing._oracle import scaled_scores
from ringdilated.testing._tolerance import FLOORS, allowed_error, max_error, non_finite_violation
from ringdilated.testing.kernel_cases import (
    DEFAULT_SPACE,
    CaseSpace,
    KernelCase,
    _visible,
    contract_backward,
    dense,
    kernel_cases,
)

__all__ = [
    "CHECKS",
    "DROPOUT_PROBABILITIES",
    "CaseSpace",
    "ConformanceError",
    "ConformanceReport",
    "KernelCase",
    "applicable_checks",
    "check_kernel",
    "kernel_cases",
]

CHECKS = (
    "capabilities",
    "forward",
    "causal",
    "empty-rows",
    "gradients",
    "split-merge",
    "no-mutation",
    "non-finite",
    "non-finite-gradients",
    "dropout",
    "softcap",
    "softcap-gradients",
    "softcap-dropout",
)
#: The dropout probabilities the ``dropout`` check draws.
DROPOUT_PROBABILITIES = (0.1, 0.5)
#: Probabilities above this are read back from a half-precision ``out`` to within 1% (smaller
#: ones may round to 0 in float16): the ``dropout`` check counts kept entries among them.
_JUDGED_PROBABILITY = 1e-4
_NEEDS_CAUSAL = frozenset({"causal", "empty-rows"})
_NEEDS_BACKWARD = frozenset(
    {"gradients", "split-merge", "non-finite-gradients", "softcap-gradients"}
)
_NEEDS_SOFTCAP = frozenset({"softcap", "softcap-gradients", "softcap-dropout"})
_NEEDS_DROPOUT = frozenset({"dropout", "softcap-dropout"})


@attrs.frozen
class ConformanceReport:
    """What ran: the checks that passed, the expected failures that did fail, and the checks
    that do not apply to what the backend declares."""

    kernel: str
    passed: tuple[str, ...]
    expected_failures: tuple[str, ...]
    not_applicable: tuple[str, ...] = ()


def _within(
    check: str,
    what: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    baseline: torch.Tensor | tuple[torch.Tensor, ...],
    dtype: torch.dtype,
    case: KernelCase,
    inherent: torch.Tensor | None = None,
) -> None:
    """The tolerance rule (:func:`~ringdilated.testing.allowed_error`) as a conformance check.

    ``baseline``: one or several plain dense computations in ``dtype``, the rule taking the least
    accurate. For gradients (:func:`_reference_gradients`) they are its baseline and formula, and
    ``inherent`` is its ``given``, whose distance from ``expected`` (what the contract's rounding
    costs any kernel) is allowed on top.
    """
    error = max_error(actual, expected)
    extra = 0.0 if inherent is None else max_error(inherent, expected)
    allowed = allowed_error(expected, baseline, dtype, extra)
    if not error <= allowed:
        raise ConformanceError(
            check, f"{what}: max error {error:.3e} vs float64 exceeds {allowed:.3e} for {case}"
        )


def _dout(q: torch.Tensor, seed: int) -> torch.Tensor:
    """A float64 upstream gradient shaped like ``q``, drawn from ``seed``."""
    return torch.randn(q.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _reference_gradients(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: KernelCase
) -> tuple[tuple[torch.Tensor, ...], ...]:
    """``(expected, baseline, given, formula)``, each ``(dq, dk, dv)`` of ``sum(out * dout)``
    (``dout`` float64): float64 autograd through dense attention; autograd through dense
    attention in ``q``'s dtype; and the contract's backward on the exact ``out`` and ``lse``
    rounded as the contract stores them (``out`` to the input dtype, ``lse`` to float32, or
    float64 for float64 inputs), evaluated exactly (``given``: what that rounding alone costs
    any kernel) and in the accumulation dtype (``formula``: the plain dense computation a fused
    kernel makes). All from the exact forward, never from the kernel's own, so a wrong forward
    cannot widen its own allowance."""
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    cap = case.softcap
    exact_out, exact_lse = dense(exact[0], exact[1], exact[2], case.scale, case.window, softcap=cap)
    expected = torch.autograd.grad((exact_out * dout).sum(), exact)
    base = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    base_out, _ = dense(base[0], base[1], base[2], case.scale, case.window, q.dtype, softcap=cap)
    baseline = torch.autograd.grad((base_out * dout.to(q.dtype)).sum(), base)
    stored = exact_out.detach().to(q.dtype), exact_lse.detach().to(accumulation_dtype(q.dtype))
    args = (dout.to(q.dtype), q, k, v, *stored, case.scale, case.window)
    given = contract_backward(*args, softcap=cap)
    formula = contract_backward(*args, dtype=accumulation_dtype(q.dtype), softcap=cap)
    return expected, baseline, given, formula


def _check_gradient_layout(
    check: str, grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor]
) -> None:
    """Each of ``dq``, ``dk``, ``dv`` shaped and typed as its input, per the kernel contract."""
    for name, grad, x in zip(("dq", "dk", "dv"), grads, inputs, strict=True):
        if grad.shape != x.shape or grad.dtype != x.dtype:
            raise ConformanceError(
                check,
                f"{name} is {tuple(grad.shape)} {grad.dtype}, expected {tuple(x.shape)} {x.dtype}",
            )


def _check_layout(check: str, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """``out`` shaped and typed as ``q``; ``lse`` as ``q`` without D, float32 (float64 for
    float64 inputs), per the kernel contract."""
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ConformanceError(
            check, f"out is {tuple(out.shape)} {out.dtype}, expected {tuple(q.shape)} {q.dtype}"
        )
    wanted = accumulation_dtype(q.dtype)
    if lse.shape != q.shape[:-1] or lse.dtype != wanted:
        raise ConformanceError(
            check, f"lse is {tuple(lse.shape)} {lse.dtype}, expected {tuple(q.shape[:-1])} {wanted}"
        )


def _check_forward(kernel: Kernel, case: KernelCase, check: str = "forward") -> None:
    q, k, v = case.tensors()
    out, lse = kernel.forward(q, k, v, case.options())
    _check_layout(check, q, out, lse)
    cap = case.softcap
    expected_out, expected_lse = dense(q, k, v, case.scale, case.window, softcap=cap)
    # The baseline is plain dense attention in the inputs' dtype, for out and lse alike.
    base_out, base_lse = dense(q, k, v, case.scale, case.window, q.dtype, softcap=cap)
    _within(check, "out", out, expected_out, base_out, q.dtype, case)
    _within(check, "lse", lse, expected_lse, base_lse, q.dtype, case)


def _check_gradients(
    kernel: Kernel,
    case: KernelCase,
    check: str = "gradients",
    empty_row_windows: Sequence[KeyWindow] = (),
) -> None:
    """Backward of one block against float64 autograd; for a kernel with the contract's optional
    ``backward_with_lse``, also :func:`_check_lse_gradients` on the case and on each of
    ``empty_row_windows``."""
    q, k, v = case.tensors()
    out, lse = kernel.forward(q, k, v, case.options())
    dout = _dout(q, case.seed + 2)
    lay_out = case.lay_out  # out, dout and lse arrive as strided views too, as in the driver
    grads = kernel.backward(
        lay_out(dout.to(q.dtype)), q, k, v, lay_out(out), lay_out(lse), case.options()
    )
    _check_gradient_layout(check, grads, (q, k, v))
    expected, baseline, given, formula = _reference_gradients(dout, q, k, v, case)
    for name, actual, exp, b, f, inherent in zip(
        ("dq", "dk", "dv"), grads, expected, baseline, formula, given, strict=True
    ):
        _within(check, name, actual, exp, (b, f), q.dtype, case, inherent)
    if getattr(kernel, "backward_with_lse", None) is not None:
        for windowed in (case, *(attrs.evolve(case, window=w) for w in empty_row_windows)):
            _check_lse_gradients(kernel, windowed, check)


def _dlse(lse: torch.Tensor, seed: int) -> torch.Tensor:
    """A float64 gradient of the lse, shaped like it, drawn from ``seed``: nonzero on every row,
    those whose lse is ``-inf`` (they see no key) included."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(lse.shape, generator=g, dtype=torch.float64)


def _lse_term(
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
    case: KernelCase,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``sum(dlse * lse)`` in ``dtype`` given ``lse``: ``d lse_i / d s_ij =
    P_ij``, the contract's backward (:func:`contract_backward`) with ``v = e_0``, ``dout_i =
    dlse_i e_0`` and ``out = 0`` (:func:`~ringdilated.core.contract.lse.lse_gradient`'s identity),
    ``dv = 0`` (the lse does not depend on ``v``). A row that sees no key has ``P = 0``: its lse
    is the constant ``-inf``, so its ``dlse`` reaches no gradient."""
    e0 = torch.zeros(v.shape, dtype=dtype)
    e0[..., 0] = 1
    carried = torch.zeros(q.shape, dtype=dtype)
    carried[..., 0] = dlse.to(dtype)
    dq, dk, _ = contract_backward(
        carried, q, k, e0, torch.zeros_like(carried), lse, case.scale, case.window, dtype,
        softcap=case.softcap,
    )  # fmt: skip
    return dq, dk, torch.zeros(v.shape, dtype=dtype)


def _check_lse_gradients(kernel: Kernel, case: KernelCase, check: str) -> None:
    """The kernel's ``backward_with_lse`` (kernel contract, :class:`LseGradientKernel`) gives the
    float64 oracle's ``(dq, dk, dv)`` of ``sum(dout * out) + sum(dlse * lse)``, ``dlse`` random
    on every row: where a row sees no key its lse is ``-inf`` whatever the inputs, so its
    ``dlse`` adds nothing (the rule of :func:`~ringdilated.core.contract.lse.lse_gradient`, the
    driver's fallback, and of the bottom-right pieces, which hold no such row). The
    tolerance is the ``gradients`` check's, each of its references given the lse term in its
    own dtype."""
    q, k, v = case.tensors()
    out, lse = kernel.forward(q, k, v, case.options())
    dout, dlse = _dout(q, case.seed + 2), _dlse(lse, case.seed + 3)
    lay_out = case.lay_out
    grads = kernel.backward_with_lse(  # type: ignore[attr-defined]
        lay_out(dout.to(q.dtype)), lay_out(dlse.to(lse.dtype)), q, k, v, lay_out(out),
        lay_out(lse), case.options(),
    )  # fmt: skip
    _check_gradient_layout(check, grads, (q, k, v))
    expected, baseline, given, formula = _reference_gradients(dout, q, k, v, case)
    exact_lse = dense(q, k, v, case.scale, case.window, softcap=case.softcap)[1]
    stored_lse = exact_lse.to(accumulation_dtype(q.dtype))
    plus = {  # each reference's lse term: exact, in q's dtype, rounded lse, accumulation dtype
        "expected": _lse_term(dlse, q, k, v, exact_lse, case, torch.float64),
        "baseline": _lse_term(dlse, q, k, v, exact_lse.to(q.dtype), case, q.dtype),
        "given": _lse_term(dlse, q, k, v, stored_lse, case, torch.float64),
        "formula": _lse_term(dlse, q, k, v, stored_lse, case, accumulation_dtype(q.dtype)),
    }
    for i, (name, actual) in enumerate(zip(("dq", "dk", "dv"), grads, strict=True)):
        exp, b, f, inherent = (
            ref[i] + plus[key][i].to(ref[i].dtype)
            for ref, key in (
                (expected, "expected"),
                (baseline, "baseline"),
                (formula, "formula"),
                (given, "given"),
            )
        )
        _within(check, f"{name} with the lse's gradient", actual, exp, (b, f), q.dtype, case,
                inherent)  # fmt: skip


def _probabilities(
    q: torch.Tensor, k: torch.Tensor, case: KernelCase, dtype: torch.dtype
) -> torch.Tensor:
    """``(N, H, Lq, Lk)``: softmax over each query's visible keys in ``dtype`` (scores capped by
    ``case.softcap``), 0 elsewhere (and in rows that see no key)."""
    scores = scaled_scores(q, k, case.scale, dtype)
    if case.softcap is not None:
        scores = torch.tanh(scores / case.softcap) * case.softcap
    visible = _case_visible(case, q.device)
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
    return torch.where(visible, probs, probs.new_zeros(())).nan_to_num(0.0)


def _case_visible(case: KernelCase, device: torch.device) -> torch.Tensor:
    """``(Lq, Lk)`` bool: key ``j`` visible to query ``i`` in ``case``."""
    return _visible(case.q_len, case.k_len, case.window, device)


def _weights(kernel: Kernel, case: KernelCase, options: BlockOptions) -> torch.Tensor:
    """``(N, H, Lq, Lk)`` float64: the weight ``kernel``'s forward gives each value under
    ``options`` (its dropout mask included), read with one-hot values ``D`` keys per call. A mask
    is drawn from the seed and the block's shape, never from the values, so every call sees the
    same one (a kernel whose mask moves between calls fails the check)."""
    q, k, v = case.tensors()
    k_len, dim = v.shape[-2], v.shape[-1]
    columns = []
    for start in range(0, k_len, dim):
        width = min(dim, k_len - start)
        basis = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
        keys = torch.arange(width, device=v.device)
        basis[:, :, start + keys, keys] = 1
        out, _ = kernel.forward(q, k, case.lay_out(basis), options)
        columns.append(out[..., :width].double())
    return torch.cat(columns, -1)


def _check_dropout(
    kernel: Kernel, case: KernelCase, backward: bool, check: str = "dropout"
) -> None:
    q, k, v = case.tensors()
    cap = case.softcap
    p = DROPOUT_PROBABILITIES[case.seed % 2]
    options = attrs.evolve(case.options(), dropout_p=p, dropout_seed=derive_seed(case.seed, 7))
    out, lse = kernel.forward(q, k, v, options)
    _check_layout(check, q, out, lse)
    again = kernel.forward(q, k, v, options)
    if not (torch.equal(out, again[0]) and torch.equal(lse, again[1])):
        raise ConformanceError(
            check, f"two forwards with one dropout seed differ (the mask must be a function "
            f"of the seed and the block's shape), for {case}"
        )  # fmt: skip
    weights = _weights(kernel, case, options)
    probs = _probabilities(q, k, case, torch.float64)
    keep = weights * (1.0 - p) > probs / 2
    drop = keep.double() / (1.0 - p)
    base_probs = _probabilities(q, k, case, q.dtype).double()
    _within(check, "the weight of each value (0, or P / (1 - p))", weights, probs * drop,
            base_probs * drop, q.dtype, case)  # fmt: skip
    window = case.window
    expected_out, expected_lse = dense(q, k, v, case.scale, window, drop=drop, softcap=cap)
    base_out, base_lse = dense(q, k, v, case.scale, window, q.dtype, drop=drop, softcap=cap)
    _within(check, "out", out, expected_out, base_out, q.dtype, case)
    _within(check, "lse (of the undropped scores)", lse, expected_lse, base_lse, q.dtype, case)
    judged = probs > _JUDGED_PROBABILITY  # read back exactly in every dtype
    count = int(judged.sum())
    if count >= 64:
        kept = float(keep[judged].double().mean())
        # Six standard deviations, plus 1/256: fused kernels compare 8-bit random numbers
        # (flash-attn keeps an entry when its byte is <= floor((1 - p) * 255)).
        spread = 6 * (p * (1 - p) / count) ** 0.5 + 1 / 256
        if abs(kept - (1 - p)) > spread:
            raise ConformanceError(
                check, f"kept {kept:.3f} of {count} probabilities with dropout_p={p} "
                f"(expected {1 - p:.3f} +- {spread:.3f}), for {case}"
            )  # fmt: skip
        other = attrs.evolve(options, dropout_seed=derive_seed(case.seed, 8))
        if torch.equal(_weights(kernel, case, other), weights):
            raise ConformanceError(check, f"another dropout seed gave the same mask, for {case}")
    if backward:
        _check_dropout_gradients(kernel, case, options, (out, lse), drop, check)


def _check_dropout_gradients(
    kernel: Kernel,
    case: KernelCase,
    options: BlockOptions,
    forward: tuple[torch.Tensor, torch.Tensor],
    drop: torch.Tensor,
    check: str = "dropout",
) -> None:
    """The backward with the forward's seed against the oracle under the mask read back."""
    q, k, v = case.tensors()
    cap, window = case.softcap, case.window
    out, lse = forward
    dout = _dout(q, case.seed + 2)
    lay_out = case.lay_out
    grads = kernel.backward(lay_out(dout.to(q.dtype)), q, k, v, lay_out(out), lay_out(lse), options)
    _check_gradient_layout(check, grads, (q, k, v))
    exact = [x.detach().double().requires_grad_() for x in (q, k, v)]
    exact_out, exact_lse = dense(
        exact[0], exact[1], exact[2], case.scale, window, drop=drop, softcap=cap
    )
    expected = torch.autograd.grad((exact_out * dout).sum(), exact)
    base = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    base_out, _ = dense(base[0], base[1], base[2], case.scale, window, q.dtype, drop, cap)
    baseline = torch.autograd.grad((base_out * dout.to(q.dtype)).sum(), base)
    stored = exact_out.detach().to(q.dtype), exact_lse.detach().to(accumulation_dtype(q.dtype))
    args = (dout.to(q.dtype), q, k, v, *stored, case.scale, window)
    given = contract_backward(*args, drop=drop, softcap=cap)
    formula = contract_backward(*args, dtype=accumulation_dtype(q.dtype), drop=drop, softcap=cap)
    for name, actual, exp, b, f, inherent in zip(
        ("dq", "dk", "dv"), grads, expected, baseline, formula, given, strict=True
    ):
        _within(check, f"{name} under the mask", actual, exp, (b, f), q.dtype, case, inherent)


def _check_capabilities(kernel: Kernel, case: KernelCase, backward: bool) -> None:
    """Declared means it runs: shapes and dtypes per the contract, finite where rows see keys."""
    q, k, v = case.tensors()
    out, lse = kernel.forward(q, k, v, case.options())
    _check_layout("capabilities", q, out, lse)
    if backward:
        kernel.backward(torch.ones_like(out), q, k, v, out, lse, case.options())


def _empty_row_windows(case: KernelCase, causal: bool, sliding: bool) -> list[KeyWindow]:
    """Windows under which some rows of ``case`` see no key: the first rows (a right bound
    below them, where causal masking is declared); with sliding windows declared, the last rows
    (a left bound above them) and both at once (a band, which for short blocks hides every
    key from every row)."""
    rows = min(case.q_len, 3)
    end = case.q_len - rows - case.k_len  # rows from q_len - rows on see no key
    windows = [KeyWindow(None, -rows)] if causal else []
    if sliding:
        windows.append(KeyWindow(end, None))
        if causal:
            windows.append(KeyWindow(end, -rows))
    return windows


def _check_empty_rows(
    kernel: Kernel, case: KernelCase, causal: bool = True, sliding: bool = False
) -> None:
    """Rows that see no key give ``out = 0`` and ``lse = -inf`` (never NaN), under each of
    :func:`_empty_row_windows`; the rows that see keys match the oracle."""
    q, k, v = case.tensors()
    for window in _empty_row_windows(case, causal, sliding):
        windowed = attrs.evolve(case, window=window)
        out, lse = kernel.forward(q, k, v, windowed.options())
        empty = _case_visible(windowed, q.device).any(-1).logical_not()  # (Lq,)
        if not bool(torch.isneginf(lse[..., empty]).all()):
            raise ConformanceError(
                "empty-rows",
                f"lse of rows with no key is {lse[..., empty].flatten()[:4].tolist()}, "
                f"expected -inf, for {windowed}",
            )
        if not bool((out[..., empty, :] == 0).all()):
            raise ConformanceError(
                "empty-rows",
                f"out of rows with no key is not 0 (NaN: {bool(out.isnan().any())}) for {windowed}",
            )
        expected_out, expected_lse = dense(q, k, v, case.scale, window)
        base_out, base_lse = dense(q, k, v, case.scale, window, q.dtype)
        seen = empty.logical_not()
        _within("empty-rows", "out of the rows that see keys", out[..., seen, :],
                expected_out[..., seen, :], base_out[..., seen, :], q.dtype, windowed)  # fmt: skip
        _within("empty-rows", "lse of the rows that see keys", lse[..., seen],
                expected_lse[..., seen], base_lse[..., seen], q.dtype, windowed)  # fmt: skip


def _check_split_merge(kernel: Kernel, case: KernelCase, check: str = "split-merge") -> None:
    q, k, v = case.tensors()
    split = max(1, case.k_len // 2)
    if split >= case.k_len:
        return
    parts = [(0, split), (split, case.k_len)]

    def opts(start: int) -> BlockOptions:  # keys from ``start``: the window shifted to them
        return BlockOptions(case.scale, case.window.shifted(-start), softcap=case.softcap)

    out, lse = kernel.forward(q, k[:, :, :split], v[:, :, :split], opts(0))
    out, lse = merge_partials(
        out, lse, *kernel.forward(q, k[:, :, split:], v[:, :, split:], opts(split))
    )
    whole_out, whole_lse = kernel.forward(q, k, v, case.options())
    tol = 1e-9 if q.dtype == torch.float64 else 50 * FLOORS[q.dtype]
    finite_lse = whole_lse.masked_fill(torch.isneginf(whole_lse), 0)  # for its magnitude
    for what, merged, whole, magnitude in (
        ("forward differs from the whole block", out, whole_out, whole_out),
        ("lse differs from the whole block's", lse, whole_lse, finite_lse),
    ):
        error = max_error(merged, whole)
        if error > tol * max(1.0, float(magnitude.abs().max())):
            raise ConformanceError(check, f"merged {what} by {error:.3e} for {case}")
    dout = _dout(q, case.seed + 1)
    expected, baseline, given, formula = _reference_gradients(dout, q, k, v, case)
    dq, dk, dv = (torch.zeros_like(x, dtype=torch.float64) for x in (q, k, v))
    for start, stop in parts:
        gq, gk, gv = kernel.backward(
            case.lay_out(dout.to(q.dtype)),
            q,
            k[:, :, start:stop],
            v[:, :, start:stop],
            case.lay_out(out.to(q.dtype)),
            case.lay_out(lse),
            opts(start),
        )
        dq += gq.double()
        dk[:, :, start:stop] += gk.double()
        dv[:, :, start:stop] += gv.double()
    for name, actual, exp, b, f, inherent in zip(
        ("dq", "dk", "dv"), (dq, dk, dv), expected, baseline, formula, given, strict=True
    ):
        what = f"{name} from two blocks with the merged out/lse"
        _within(check, what, actual.to(q.dtype), exp, (b, f), q.dtype, case, inherent)


def _check_no_mutation(kernel: Kernel, case: KernelCase, backward: bool) -> None:
    q, k, v = case.tensors()
    before = [x.clone() for x in (q, k, v)]
    out, lse = kernel.forward(q, k, v, case.options())
    if backward:
        kernel.backward(torch.ones_like(out), q, k, v, out, lse, case.options())
    for name, x, b in zip("qkv", (q, k, v), before, strict=True):
        if not torch.equal(x, b):
            raise ConformanceError("no-mutation", f"{name} was modified in place for {case}")


def _corrupt(case: KernelCase, tensors: list[torch.Tensor], salt: int = 0) -> list[torch.Tensor]:
    """``tensors`` (``q``, ``k``, ``v`` and maybe ``dout``) corrupted in place, as the seed
    says. Three cases in four: one or two elements of one tensor set to NaN, +inf or -inf. One
    in four: a query whose visible scores are all ``-inf`` (``q[..., 0] = +inf`` against keys
    whose first component is negative), the row flash-style kernels take for fully masked and
    return as zeros, where softmax gives NaN."""
    g = torch.Generator().manual_seed(case.seed + 3 + salt)

    def index(shape: torch.Size) -> tuple[int, ...]:
        return tuple(int(torch.randint(0, n, (), generator=g)) for n in shape)

    if (case.seed // 9 + salt) % 4 == 3:
        q, k = tensors[0], tensors[1]
        n, h, i, _ = index(q.shape)
        kv = h // (q.shape[1] // k.shape[1])
        k[n, kv, :, 0] = -(k[n, kv, :, 0].abs() + 0.5)
        q[n, h, i, 0] = float("inf")
        return tensors
    target = tensors[(case.seed + salt) % len(tensors)]
    value = (float("nan"), float("inf"), float("-inf"))[(case.seed // 3) % 3]
    for _ in range(1 + case.seed % 2):
        target[index(target.shape)] = value
    return tensors


def _not_finite(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return torch.isfinite(x).logical_not().any(dim=dims)


def _per_query_head(per_kv_head: torch.Tensor, heads: int) -> torch.Tensor:
    """``(N, Hkv)`` to ``(N, heads)`` by the contract's grouping."""
    return per_kv_head.repeat_interleave(heads // per_kv_head.shape[1], dim=1)


def _forward_nan_allowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``(N, H, Lq)``: rows NaN may reach besides the exact ones: the query row itself is
    non-finite, or any ``k``/``v`` of its problem (its ``n`` and key/value head) is."""
    problem = _not_finite(k, (-2, -1)) | _not_finite(v, (-2, -1))  # (N, Hkv)
    return _not_finite(q, (-1,)) | _per_query_head(problem, q.shape[1]).unsqueeze(-1)


def _backward_nan_allowed(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For ``dq``, ``dk``, ``dv``: ``(N, H, 1, 1)``, ``(N, Hkv, 1, 1)`` twice: the problems any
    of whose inputs (``q``, ``k``, ``v``, ``dout``) is non-finite, by query head and by key/value
    head: NaN may reach all their gradients."""
    n, heads = q.shape[:2]
    kv_heads = k.shape[1]
    per_head = _not_finite(q, (-2, -1)) | _not_finite(dout, (-2, -1))
    problem = _not_finite(k, (-2, -1)) | _not_finite(v, (-2, -1))
    problem = problem | per_head.view(n, kv_heads, heads // kv_heads).any(-1)
    by_kv_head = problem[..., None, None]
    return _per_query_head(problem, heads)[..., None, None], by_kv_head, by_kv_head


def _non_finite_rule(
    check: str,
    what: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    baselines: Sequence[torch.Tensor],
    may_be_nan: torch.Tensor,
    dtype: torch.dtype,
    case: KernelCase,
    extra: Sequence[torch.Tensor] = (),
) -> None:
    try:
        problem = non_finite_violation(actual, expected, baselines, may_be_nan, dtype, extra)
    except ValueError as error:  # a baseline that cannot judge: the case is out of range
        problem = f"cannot judge ({error})"
    if problem is not None:
        raise ConformanceError(check, f"{what}: {problem}, for {case}")


def _check_non_finite(kernel: Kernel, case: KernelCase) -> None:
    q, k, v = _corrupt(case, list(case.tensors()))
    out, lse = kernel.forward(q, k, v, case.options())
    _check_layout("non-finite", q, out, lse)
    expected_out, expected_lse = dense(q, k, v, case.scale, case.window)
    base_out, base_lse = dense(q, k, v, case.scale, case.window, q.dtype)
    allowed = _forward_nan_allowed(q, k, v)
    for what, actual, expected, base, may in (
        ("out", out, expected_out, base_out, allowed.unsqueeze(-1)),
        ("lse", lse, expected_lse, base_lse, allowed),
    ):
        _non_finite_rule("non-finite", what, actual, expected, (base,), may, q.dtype, case)


def _check_non_finite_gradients(kernel: Kernel, case: KernelCase) -> None:
    q, k, v = case.tensors()
    q, k, v, dout = _corrupt(case, [q, k, v, _dout(q, case.seed + 2).to(q.dtype)], salt=1)
    out, lse = kernel.forward(q, k, v, case.options())
    lay_out = case.lay_out
    grads = kernel.backward(lay_out(dout), q, k, v, lay_out(out), lay_out(lse), case.options())
    _check_gradient_layout("non-finite-gradients", grads, (q, k, v))
    expected, baseline, given, formula = _reference_gradients(dout.double(), q, k, v, case)
    may_be_nan = _backward_nan_allowed(dout, q, k, v)
    for name, actual, exp, b, f, inherent, may in zip(
        ("dq", "dk", "dv"), grads, expected, baseline, formula, given, may_be_nan, strict=True
    ):
        _non_finite_rule(
            "non-finite-gradients", name, actual, exp, (b, f), may, q.dtype, case, (inherent,)
        )
    _check_merged_non_finite(kernel, case)


def _check_merged_non_finite(kernel: Kernel, case: KernelCase) -> None:
    """A block whose inputs are finite, handed a merged ``lse`` that another block made NaN or
    ``+inf`` in one row (and ``out`` NaN there), as a sharded or ``longnet`` call hands it:
    that row's ``dq`` and the ``dk`` and ``dv`` of the keys it sees must be non-finite, as the
    exact math makes them (a merged lse is ``+inf`` only through a ``+inf`` score, whose softmax
    row is NaN throughout, so every ``P`` of the row is NaN; a flash-style ``exp(s - lse) = 0``
    is not), and every other problem's gradients must be what they are with the clean lse."""
    q, k, v = case.tensors()
    n, heads, q_len = q.shape[:3]
    kv_heads, k_len = k.shape[1], k.shape[2]
    first, stop = case.window.visible_rows(q_len, k_len)  # the rows that see a key
    if first >= stop or n == 0:
        return
    g = torch.Generator().manual_seed(case.seed + 5)
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64).to(q.dtype)
    out, lse = kernel.forward(q, k, v, case.options())
    pick = [int(torch.randint(0, x, (), generator=g)) for x in (n, heads)]
    row = int(torch.randint(first, stop, (), generator=g))
    value = float("nan") if case.seed % 2 else float("inf")
    bad_lse, bad_out = lse.clone(), out.clone()
    bad_lse[pick[0], pick[1], row] = value
    bad_out[pick[0], pick[1], row] = float("nan")
    lay_out = case.lay_out
    clean = kernel.backward(lay_out(dout), q, k, v, lay_out(out), lay_out(lse), case.options())
    grads = kernel.backward(
        lay_out(dout), q, k, v, lay_out(bad_out), lay_out(bad_lse), case.options()
    )
    kv = pick[1] // (heads // kv_heads)
    seen = slice(*case.window.visible_keys(row, row + 1, k_len))  # the keys the row sees
    required = [
        ("dq", grads[0][pick[0], pick[1], row]),
        ("dk", grads[1][pick[0], kv, seen]),
        ("dv", grads[2][pick[0], kv, seen]),
    ]
    for name, part in required:
        if bool(torch.isfinite(part).any()):
            raise ConformanceError(
                "non-finite-gradients",
                f"with a merged lse of {value} in row {row} of problem {pick[0]}, head "
                f"{pick[1]} (finite inputs), {name} has finite entries where the exact math is "
                f"non-finite: NaN or infinity was turned into finite numbers, for {case}",
            )
    for name, actual, reference in zip(("dq", "dk", "dv"), grads, clean, strict=True):
        others = torch.ones(actual.shape[:2], dtype=torch.bool)
        others[pick[0], pick[1] if name == "dq" else kv] = False
        if name == "dq":  # the query heads that read the same key/value head are that problem
            group = heads // kv_heads
            others[pick[0], kv * group : (kv + 1) * group] = False
        if not torch.equal(actual[others], reference[others]):
            raise ConformanceError(
                "non-finite-gradients",
                f"a merged lse of {value} in row {row} of problem {pick[0]}, head {pick[1]} "
                f"changed {name} of another problem (NaN or any value may not cross problems), "
                f"for {case}",
            )


def _check_softcap_gradients(kernel: Kernel, case: KernelCase) -> None:
    """``gradients`` and ``split-merge`` under the case's cap."""
    _check_gradients(kernel, case, "softcap-gradients")
    _check_split_merge(kernel, case, "softcap-gradients")


_RUNNERS: dict[str, Callable[[Kernel, KernelCase, bool], None]] = {  # (kernel, case, backward)
    "capabilities": _check_capabilities,
    "forward": lambda kernel, case, _: _check_forward(kernel, case),
    "causal": lambda kernel, case, _: _check_forward(kernel, case, "causal"),
    "empty-rows": lambda kernel, case, _: _check_empty_rows(kernel, case),
    "gradients": lambda kernel, case, _: _check_gradients(kernel, case),
    "split-merge": lambda kernel, case, _: _check_split_merge(kernel, case),
    "no-mutation": _check_no_mutation,
    "non-finite": lambda kernel, case, _: _check_non_finite(kernel, case),
    "non-finite-gradients": lambda kernel, case, _: _check_non_finite_gradients(kernel, case),
    "dropout": _check_dropout,
    "softcap": lambda kernel, case, _: _check_forward(kernel, case, "softcap"),
    "softcap-gradients": lambda kernel, case, _: _check_softcap_gradients(kernel, case),
    "softcap-dropout": lambda kernel, case, backward: _check_dropout(
        kernel, case, backward, "softcap-dropout"
    ),
}
_CAUSAL_CASES: dict[str, bool | None] = {"forward": False, "causal": True}


def _has_backward(spec: KernelSpec, device: str) -> bool:
    return spec.capabilities.backward and any(
        t.backward for t in spec.capabilities.targets if t.device_type == device
    )


def applicable_checks(
    spec: KernelSpec, device: str = "cpu", env: Environment | None = None
) -> tuple[str, ...]:
    """The checks of :data:`CHECKS` that apply to what ``spec`` declares on ``device`` (in
    ``env``, as :func:`check_kernel` takes it), in order: what a report of a conforming kernel
    lists as passed."""
    return tuple(check for check in CHECKS if _applies(check, spec, device, env))


def _applies(check: str, spec: KernelSpec, device: str, env: Environment | None = None) -> bool:
    caps = spec.capabilities
    if check in _NEEDS_CAUSAL and not (caps.causal or caps.sliding_window):
        return False
    features: dict[str, object] = {}
    if check in _NEEDS_DROPOUT:
        features["dropout"] = True
    if check in _NEEDS_SOFTCAP:
        features["softcap"] = 1.0
    if features and not _serves(spec, device, env, features):
        return False
    return check not in _NEEDS_BACKWARD or _has_backward(spec, device)


def _serves(
    spec: KernelSpec, device: str, env: Environment | None, features: dict[str, object]
) -> bool:
    """Whether ``spec`` serves ``features`` (:class:`Request` fields: ``dropout``, ``softcap``)
    together on ``device``, on the requests the kit draws (with gradients where it declares
    them): it declares each, and on some declared target of the device a request with them
    meets no reason that one without them does not (a target may lack dropout, and a spec may
    refuse a feature or a combination in its ``extra_reasons``: flash-attn's softcap with
    dropout, FlashAttention 4's softcapped gradients before 4.0.0b9), in ``env`` (``None``: its
    required packages present) at the compute capability ``env`` reports."""
    caps = spec.capabilities
    if any(not getattr(caps, name) for name in features):
        return False
    env = env or Environment(frozenset(caps.requires))
    capability = env.compute_capability if device == "cuda" else None
    backward = _has_backward(spec, device)
    for target in caps.targets:
        if target.device_type != device:
            continue
        dtype = min(target.dtypes, key=str)
        plain = Request(device, dtype, None, capability, backward=backward)
        wanted = attrs.evolve(plain, **features)  # type: ignore[arg-type]
        if set(spec.reasons(wanted, env)) <= set(spec.reasons(plain, env)):
            return True
    return False


def _runner(
    check: str,
    kernel: Kernel,
    spec: KernelSpec,
    device: str,
    env: Environment | None,
    max_examples: int,
    space: CaseSpace,
) -> Callable[[], None]:
    backward = _has_backward(spec, device)
    cases = kernel_cases(
        spec,
        device,
        env,
        causal=_CAUSAL_CASES.get(check),
        backward=backward,
        space=space,
        dropout=check in _NEEDS_DROPOUT,  # drawn where a target serves it
        softcap=check in _NEEDS_SOFTCAP,
    )
    caps = spec.capabilities

    def empty_rows(kernel: Kernel, case: KernelCase, _: bool) -> None:
        _check_empty_rows(kernel, case, caps.causal, caps.sliding_window)

    def gradients(check: str) -> Callable[[Kernel, KernelCase, bool], None]:
        def run(kernel: Kernel, case: KernelCase, _: bool) -> None:
            windows = _empty_row_windows(case, caps.causal, caps.sliding_window)
            _check_gradients(kernel, case, check, windows)
            if check == "softcap-gradients":
                _check_split_merge(kernel, case, check)

        return run

    # The checks as this kernel declares them. Named as the module's table on purpose: the
    # source of ``run`` seeds hypothesis's derandomized draws (``function_digest``), so it stays
    # as it was and every kernel keeps the cases it was checked on.
    _RUNNERS = {
        **globals()["_RUNNERS"],
        "empty-rows": empty_rows,
        "gradients": gradients("gradients"),
        "softcap-gradients": gradients("softcap-gradients"),
    }

    @settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(case=cases)
    def run(case: KernelCase) -> None:
        try:
            _RUNNERS[check](kernel, case, backward)
        except ConformanceError:
            raise
        except Exception as error:
            raise ConformanceError(
                check,
                f"raised {type(error).__name__}: {error} on a case it declares it supports: {case}",
            ) from error

    def first_failure() -> None:
        try:
            run()
        except Exception as error:  # hypothesis groups several distinct failures
            failures = getattr(error, "exceptions", ())
            first = next((e for e in failures if isinstance(e, ConformanceError)), None)
            if first is None:
                raise
            raise first from error

    return first_failure


def _check_rejects_undeclared_devices(spec: KernelSpec, env: Environment | None) -> None:
    declared = {t.device_type for t in spec.capabilities.targets}
    for device in sorted({"cpu", "cuda", "meta"} - declared):
        reasons = spec.reasons(Request(device_type=device), env or Environment(frozenset()))
        if not reasons or not all(isinstance(r, str) and r for r in reasons):
            raise ConformanceError(
                "capabilities",
                f"{spec.name!r} declares no {device} target but gives reasons {reasons!r}",
            )


def check_kernel(
    kernel: str | KernelSpec,
    *,
    device: str = "cpu",
    max_examples: int = 30,
    checks: Sequence[str] = CHECKS,
    expected_failures: Mapping[str, str] | None = None,
    env: Environment | None = None,
    space: CaseSpace = DEFAULT_SPACE,
) -> ConformanceReport:
    """Run the conformance checks on a registered kernel name or a :class:`KernelSpec`.

    ``expected_failures`` maps check ids to the reason they are known to fail; such a check must
    fail (an unexpected pass raises, so a fixed bug is noticed). Raises :class:`ConformanceError`
    on the first unexpected failure.
    """
    from ringdilated.registry import default_resolver

    spec = default_resolver().specs[kernel] if isinstance(kernel, str) else kernel
    unknown = set(checks) - set(CHECKS) | set(expected_failures or ()) - set(CHECKS)
    if unknown:
        raise ValueError(
            f"unknown conformance checks {sorted(unknown)}; known: {', '.join(CHECKS)}"
        )
    instance = spec.factory()
    if not isinstance(instance, Kernel):
        raise ConformanceError(
            "interface", f"{spec.name!r}: factory returned {instance!r}, not a Kernel"
        )
    passed: list[str] = []
    failed_as_expected: list[str] = []
    not_applicable: list[str] = []
    for check in checks:
        if not _applies(check, spec, device, env):
            not_applicable.append(check)
            continue
        if check == "capabilities":
            _check_rejects_undeclared_devices(spec, env)
        run = _runner(check, instance, spec, device, env, max_examples, space)
        if expected_failures and check in expected_failures:
            try:
                run()
            except ConformanceError:
                failed_as_expected.append(check)
                continue
            raise ConformanceError(
                check, f"expected to fail ({expected_failures[check]}) but passed"
            )
        run()
        passed.append(check)
    return ConformanceReport(
        spec.name, tuple(passed), tuple(failed_as_expected), tuple(not_applicable)
    )
