"""The conformance kit passes the built-in kernels and rejects wrong ones for the right reason."""

from __future__ import annotations

import re
from typing import ClassVar

import attrs
import pytest
import torch

from ringdilated.backends._memeff import finite_lse
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.backends.sdpa import CpuFlashAttention, _mask_args
from ringdilated.core import KernelSpec, KeyWindow, Target
from ringdilated.core.contract.kernel import (
    BlockOptions,
    mark_non_finite_problems,
    mark_non_finite_rows,
)
from ringdilated.testing import ConformanceError, check_kernel
from ringdilated.testing.conformance import CHECKS
from ringdilated.testing.kernel_cases import CaseSpace


@pytest.mark.parametrize("name", ["sdpa", "reference"])
def test_builtin_kernels_conform(name: str) -> None:
    report = check_kernel(name, max_examples=20)
    # sdpa serves dropout on CUDA only (its CPU op has none) and no softcap, reference both
    not_applicable = (
        ("dropout", "softcap", "softcap-gradients", "softcap-dropout") if name == "sdpa" else ()
    )
    assert report.passed == tuple(c for c in CHECKS if c not in not_applicable)
    assert report.not_applicable == not_applicable


class IgnoresScale(ReferenceKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        return super().forward(q, k, v, attrs.evolve(options, scale=1.0))


class LseOffByConstant(ReferenceKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q, k, v, options)
        return out, lse + 0.5


class CausalWrongSign(ReferenceKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        if options.window.right is None:
            return super().forward(q, k, v, options)
        # Sees the keys at or after the diagonal instead of at or before it.
        flipped = super().forward(q.flip(-2), k.flip(-2), v.flip(-2), options)
        return flipped[0].flip(-2), flipped[1].flip(-1)


class IgnoresOffset(ReferenceKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        if options.window.right is not None:
            options = attrs.evolve(options, window=KeyWindow(None, 0))
        return super().forward(q, k, v, options)


class ReadsRightBoundOnly(ReferenceKernel):
    """Builds its mask from the right bound alone: a sliding window's left bound is lost."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        window = KeyWindow(None, options.window.right)
        return super().forward(q, k, v, attrs.evolve(options, window=window))


class LseZeroOnTrailingEmptyRows(ReferenceKernel):
    """Marks the rows before the window's first (a right bound) but reports ``lse = 0`` for the
    rows after its last (a left bound), as an op reporting its own value for them would."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q, k, v, options)
        _, stop = options.window.visible_rows(q.shape[-2], k.shape[-2])
        lse = lse.clone()
        lse[..., stop:] = 0.0
        return out, lse


class NanOnEmptyRows(ReferenceKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q, k, v, options)
        return torch.where(torch.isneginf(lse).unsqueeze(-1), float("nan"), out), lse


class RaisesOnHalf(ReferenceKernel):
    """Declares float16 (the reference does) but cannot run it."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        if q.dtype == torch.float16:
            raise RuntimeError("no half kernel")
        return super().forward(q, k, v, options)


class BackwardDrawsAnotherMask(ReferenceKernel):
    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        other = attrs.evolve(options, dropout_seed=options.dropout_seed + 1)
        return super().backward(dout, q, k, v, out, lse, other)


class IgnoresDropout(ReferenceKernel):
    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        return super().forward(q, k, v, attrs.evolve(options, dropout_p=0.0))

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        return super().backward(dout, q, k, v, out, lse, attrs.evolve(options, dropout_p=0.0))


class MaskMovesEveryCall(ReferenceKernel):
    """Draws its mask from a running stream, as a fused kernel left on the global generator."""

    calls = 0

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        MaskMovesEveryCall.calls += 1
        moved = attrs.evolve(options, dropout_seed=options.dropout_seed + self.calls)
        return super().forward(q, k, v, moved)


class LseWrongUnderDropout(ReferenceKernel):
    """Right without dropout, its lse off by one with it."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q, k, v, options)
        return out, lse + (0.0 if options.dropout_p == 0 else 1.0)


class BackwardIgnoresScale(ReferenceKernel):
    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        return super().backward(dout, q, k, v, out, lse, attrs.evolve(options, scale=1.0))


class LiesAboutFloat64(ReferenceKernel):
    """Declares float64 but computes and returns float32."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q.float(), k.float(), v.float(), options)
        return out, lse


class WrongPastFirstTile(ReferenceKernel):
    """Rows past a 128-row tile lose the scale: right on every short block."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q, k, v, options)
        if q.shape[-2] > 128:
            tail = super().forward(q[..., 128:, :], k, v, attrs.evolve(options, scale=1.0))
            out, lse = out.clone(), lse.clone()
            out[..., 128:, :], lse[..., 128:] = tail
        return out, lse


class TruncatesHeadDim(ReferenceKernel):
    """Scores from the first 64 dims only, as a kernel specialised for head dims <= 64."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        if q.shape[-1] <= 64:
            return super().forward(q, k, v, options)
        qt, kt = q.clone(), k.clone()
        qt[..., 64:], kt[..., 64:] = 0, 0
        return super().forward(qt, kt, v, options)


class AssumesContiguous(ReferenceKernel):
    """Addresses its inputs with contiguous strides, whatever strides they have."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        def dense_strides(x):  # type: ignore[no-untyped-def]
            return x.as_strided(x.shape, torch.empty(x.shape).stride(), x.storage_offset())

        return super().forward(dense_strides(q), dense_strides(k), dense_strides(v), options)


class WrongOnTileMultiples(ReferenceKernel):
    """Rows of a block whose length is a multiple of 64 lose the scale (a tile-edge bug)."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        if q.shape[-2] % 64 == 0:
            options = attrs.evolve(options, scale=1.0)
        return super().forward(q, k, v, options)


class MixesUpBatchesPastTwo(ReferenceKernel):
    """Problem ``i`` reads the keys of problem ``i % 2``: right for batches of 1 and 2."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        index = torch.arange(q.shape[0]) % 2
        return super().forward(q, k[index], v[index], options)


def _spec(kernel: type, dtypes: frozenset[torch.dtype] | None = None) -> KernelSpec:
    capabilities = REFERENCE_SPEC.capabilities
    if dtypes is not None:
        capabilities = attrs.evolve(capabilities, targets=(Target("cpu", dtypes),))
    return KernelSpec(name=kernel.__name__, factory=kernel, capabilities=capabilities)


@pytest.mark.parametrize(
    ("kernel", "dtypes", "check", "message"),
    [
        (IgnoresScale, None, "forward", "max error"),
        (LseOffByConstant, None, "forward", "lse: max error"),
        (CausalWrongSign, None, "causal", "max error"),
        (IgnoresOffset, None, "causal", "max error"),
        (ReadsRightBoundOnly, None, "causal", "max error"),
        (LseZeroOnTrailingEmptyRows, None, "empty-rows", "lse of rows with no key is [0.0"),
        (RaisesOnHalf, None, "capabilities", "raised RuntimeError: no half kernel"),
        (BackwardIgnoresScale, None, "gradients", "max error"),
        (NanOnEmptyRows, None, "empty-rows", "out of rows with no key is not 0 (NaN: True)"),
        (LiesAboutFloat64, frozenset({torch.float64}), "forward", "expected"),
        (BackwardDrawsAnotherMask, None, "dropout", "under the mask: max error"),
        (IgnoresDropout, None, "dropout", "[dropout] "),
        (MaskMovesEveryCall, None, "dropout", "[dropout] "),  # a tiny block may repeat a mask
        (LseWrongUnderDropout, None, "dropout", "lse (of the undropped scores): max error"),
    ],
)
def test_wrong_kernels_are_rejected_for_the_right_reason(kernel, dtypes, check, message) -> None:
    with pytest.raises(ConformanceError) as info:
        check_kernel(_spec(kernel, dtypes), max_examples=30, checks=(check,))
    assert info.value.check == check, str(info.value)
    assert message in str(info.value)


def test_lying_dtype_message_names_the_dtype() -> None:
    with pytest.raises(
        ConformanceError, match=r"out is .* torch\.float32, expected .* torch\.float64"
    ):
        check_kernel(_spec(LiesAboutFloat64, frozenset({torch.float64})), max_examples=10)


def test_an_expected_failure_that_fails_is_reported_not_raised() -> None:
    report = check_kernel(
        _spec(NanOnEmptyRows),
        max_examples=10,
        checks=("empty-rows", "no-mutation"),
        expected_failures={"empty-rows": "known: NaN rows"},
    )
    assert report.expected_failures == ("empty-rows",)
    assert report.passed == ("no-mutation",)


def test_an_expected_failure_that_passes_raises() -> None:
    with pytest.raises(
        ConformanceError, match=r"\[empty-rows\] expected to fail \(fixed\?\) but passed"
    ):
        check_kernel("reference", max_examples=5, expected_failures={"empty-rows": "fixed?"})


def test_unknown_check_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown conformance checks"):
        check_kernel("reference", checks=("speed",))


def test_kernel_without_causal_is_checked_without_offsets() -> None:
    capabilities = attrs.evolve(REFERENCE_SPEC.capabilities, causal=False, sliding_window=False)
    spec = attrs.evolve(_spec(ReferenceKernel), capabilities=capabilities)
    report = check_kernel(spec, max_examples=10)
    assert report.passed == (
        "capabilities",
        "forward",
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
    assert report.not_applicable == ("causal", "empty-rows")


def test_a_sliding_window_without_causal_masks_is_checked_with_left_bounds_only() -> None:
    """A kernel declaring sliding windows and no causal masking gets windows bounded on the left
    only: ``causal`` and ``empty-rows`` (its rows at the end) apply, and a kernel that drops the
    left bound fails them."""
    capabilities = attrs.evolve(REFERENCE_SPEC.capabilities, causal=False, sliding_window=True)
    spec = attrs.evolve(_spec(ReferenceKernel), capabilities=capabilities)
    checks = ("causal", "empty-rows")
    assert check_kernel(spec, max_examples=10, checks=checks).passed == checks
    wrong = attrs.evolve(spec, factory=ReadsRightBoundOnly)
    with pytest.raises(ConformanceError, match=r"\[causal\]"):
        check_kernel(wrong, max_examples=10, checks=("causal",))


def test_forward_only_target_is_not_checked_for_gradients() -> None:
    forward_only = Target("cpu", frozenset({torch.float32}), backward=False)
    spec = attrs.evolve(
        _spec(ReferenceKernel),
        capabilities=attrs.evolve(REFERENCE_SPEC.capabilities, targets=(forward_only,)),
    )
    report = check_kernel(spec, max_examples=5)
    assert report.not_applicable == (
        "gradients",
        "split-merge",
        "non-finite-gradients",
        "softcap-gradients",
    )
    assert "no-mutation" in report.passed


def test_oracle_needs_no_hypothesis_and_the_kit_says_what_it_needs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys

    import ringdilated.testing as testing

    monkeypatch.setitem(sys.modules, "hypothesis", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "ringdilated.testing.conformance")
    assert callable(testing.oracle)
    with pytest.raises(ImportError, match=r"needs 'hypothesis': pip install -e '\.\[test\]'"):
        testing.check_kernel  # noqa: B018


OLD_SPACE = CaseSpace(max_len=24, max_head_dim=64, layouts=("contiguous",), max_batch=2)


@pytest.mark.parametrize(
    ("kernel", "check", "narrowed"),
    [
        (WrongPastFirstTile, "forward", {"max_len": 24}),
        (WrongOnTileMultiples, "forward", {"max_len": 24}),
        (TruncatesHeadDim, "forward", {"max_head_dim": 64}),
        (AssumesContiguous, "forward", {"layouts": ("contiguous",)}),
        (MixesUpBatchesPastTwo, "forward", {"max_batch": 2}),
    ],
)
def test_each_dimension_of_the_case_space_catches_a_kernel_nothing_else_does(
    kernel: type, check: str, narrowed: dict[str, object]
) -> None:
    """A wrong kernel that passes the whole space but for one dimension, and fails with it."""
    without = attrs.evolve(CaseSpace(), **narrowed)  # type: ignore[misc]
    check_kernel(_spec(kernel), max_examples=25, checks=(check,), space=without)
    check_kernel(_spec(kernel), max_examples=25, checks=(check,), space=OLD_SPACE)
    with pytest.raises(ConformanceError) as info:
        check_kernel(_spec(kernel), max_examples=25, checks=(check,))
    assert info.value.check == check


class RawCpuFlash(ReferenceKernel):
    """PyTorch's CPU flash op and its backward with nothing around them: a row whose scores are
    all -inf comes back as zeros, and rows with an lse of +inf give finite gradients."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        is_causal, mask = _mask_args(q, k, options)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, is_causal, attn_mask=mask, scale=options.scale
        )
        options.mark_empty_rows(out, lse, k.shape[-2])
        return out, lse

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        is_causal, mask = _mask_args(q, k, options)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, finite_lse(lse, torch.float32), 0.0, is_causal,
            attn_mask=mask, scale=options.scale,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_raw_cpu_flash_op_turns_nan_into_numbers_and_the_kit_says_so(
    dtype: torch.dtype,
) -> None:
    """What the sdpa wrapper repairs: the op passes every finite check and fails both
    non-finite ones."""
    spec = _spec(RawCpuFlash, frozenset({dtype}))
    check_kernel(spec, max_examples=15, checks=("forward", "causal", "empty-rows", "gradients"))
    for check in ("non-finite", "non-finite-gradients"):
        # It fails in more than one way: hypothesis may report them together (a group).
        with pytest.raises(Exception) as info:  # noqa: PT011
            check_kernel(spec, max_examples=30, checks=(check,))
        errors = getattr(info.value, "exceptions", (info.value,))
        assert all(isinstance(e, ConformanceError) and e.check == check for e in errors), errors
        assert all("turned into finite numbers" in str(e) for e in errors), errors


def _dense64(q, k, v, scale, causal):  # type: ignore[no-untyped-def]
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v.double(), s.logsumexp(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize(
    ("case", "length", "causal"),
    [
        # Fewer keys than a vector: the op's scalar maximum (std::max) drops NaN, and a row
        # whose scores are all NaN is taken for fully masked: out = 0, lse = 0.
        ("nan query row", 3, False),
        ("every key nan", 3, False),
        ("first key nan", 3, True),  # row 0 sees key 0 alone
        ("infinite key", 16, False),  # bfloat16: exp gives a +inf score zero weight
        ("infinite query", 16, True),  # float32 too: the row's visible scores all -inf or NaN
    ],
)
def test_the_cpu_flash_repair_makes_non_finite_every_row_the_exact_math_does(
    dtype: torch.dtype, case: str, length: int, causal: bool
) -> None:
    """The sdpa CPU path's own repair (not the general one), case by case: every row the exact
    math makes non-finite is, problem 1 (finite inputs) stays exact, and so does every row of
    problem 0 whose own query and problem's keys are finite."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, length, 8, generator=g).to(dtype) for _ in range(3))
    corrupt = {
        "nan query row": lambda: q[0, 1, 1].fill_(float("nan")),
        "every key nan": lambda: k[0, 0].fill_(float("nan")),
        "first key nan": lambda: k[0, 1, 0].fill_(float("nan")),
        "infinite key": lambda: k[0, 0, 7, 2].fill_(float("inf")),
        "infinite query": lambda: q[0, 0, 1, 2].fill_(float("inf")),
    }
    corrupt[case]()
    options = BlockOptions(scale=0.35, window=KeyWindow(None, 0 if causal else None))
    out, lse = CpuFlashAttention().forward(q, k, v, options)
    expected, expected_lse = _dense64(q, k, v, 0.35, causal)
    must = ~torch.isfinite(expected).all(-1)
    assert must.any(), "the case makes some exact output non-finite"
    assert not torch.isfinite(out[must]).all(-1).any(), "a row the exact math makes NaN is finite"
    assert not torch.isfinite(lse[must]).any()
    bad_q = ~torch.isfinite(q).all(-1)  # (N, H, L)
    bad_k = ~torch.isfinite(k).flatten(-2).all(-1)  # (N, H)
    clean = ~(bad_q | bad_k[..., None])
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float64: 1e-12}[dtype]
    assert torch.allclose(out[clean].double(), expected[clean], atol=tolerance, rtol=0)
    assert torch.allclose(lse[clean].double(), expected_lse[clean], atol=tolerance, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("merged", [float("inf"), float("nan")])
def test_the_cpu_flash_backward_spreads_a_merged_non_finite_lse_to_what_its_row_sees(
    dtype: torch.dtype, merged: float
) -> None:
    """A merged lse of +inf (the op would give the row zero weight) or NaN, from another block:
    that row's dq and the dk, dv of the keys it sees (causal: keys 0..row) are NaN; the other
    problem's gradients are exact."""
    g = torch.Generator().manual_seed(4)
    q, k, v, dout = (torch.randn(2, 1, 16, 8, generator=g).to(dtype) for _ in range(4))
    options = BlockOptions(scale=0.35, window=KeyWindow(None, 0))
    kernel = CpuFlashAttention()
    out, lse = kernel.forward(q, k, v, options)
    lse = lse.clone()
    lse[0, 0, 6] = merged
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, options)
    assert dq[0, 0, 6].isnan().all()
    assert dk[0, 0, :7].isnan().all(-1).all() and dv[0, 0, :7].isnan().all(-1).all()
    exact = [x[1:].double().requires_grad_() for x in (q, k, v)]
    grads = torch.autograd.grad((_dense64(*exact, 0.35, True)[0] * dout[1:].double()).sum(), exact)
    tolerance = {torch.float32: 1e-4, torch.bfloat16: 5e-2}[dtype]
    for got, want in zip((dq, dk, dv), grads, strict=True):
        assert torch.allclose(got[1:].double(), want, atol=tolerance, rtol=0)


class NanToNumbers(ReferenceKernel):
    """Hides NaN and infinity from its caller: the silent corruption the rule forbids."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q, k, v, options)
        return out.nan_to_num(0.0, 0.0, 0.0), lse.nan_to_num(0.0, posinf=0.0)


class NanToNumbersInBackward(ReferenceKernel):
    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        grads = super().backward(dout, q, k, v, out, lse, options)
        return tuple(g.nan_to_num(0.0, 0.0, 0.0) for g in grads)


class SpreadsAcrossProblems(ReferenceKernel):
    """A NaN anywhere in the batch reaches every output (a shared reduction gone wrong)."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q, k, v, options)
        return out + out.sum() * 0, lse


class SpreadsAcrossHeads(ReferenceKernel):
    """NaN crosses key/value heads within a problem's ``n``, in backward."""

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        dq, dk, dv = super().backward(dout, q, k, v, out, lse, options)
        return dq, dk + dk.sum(dim=(1, 2, 3), keepdim=True) * 0, dv


class PoisonsItsProblems(ReferenceKernel):
    """NaN in every row of a problem holding a non-finite key or value, and in every gradient of
    a problem holding any: what the contract allows (and the built-in fused kernels do)."""

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q, k, v, options)
        mark_non_finite_rows(out, lse, q, k, v, options)
        return out, lse

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        dq, dk, dv = super().backward(dout, q, k, v, out, lse, options)
        mark_non_finite_problems(dq, dk, dv, dout, q, k, v, lse)
        return dq, dk, dv


@pytest.mark.parametrize(
    ("kernel", "check", "message"),
    [
        (NanToNumbers, "non-finite", "turned into finite numbers"),
        (NanToNumbersInBackward, "non-finite-gradients", "turned into finite numbers"),
        (SpreadsAcrossProblems, "non-finite", "reached outputs it must not"),
        # Either way the check finds it first: a NaN input reaching another problem's
        # gradients, or a merged non-finite lse changing them.
        (
            SpreadsAcrossHeads,
            "non-finite-gradients",
            "reached outputs it must not|of another problem",
        ),
    ],
)
def test_kernels_that_hide_or_spread_nan_are_rejected(
    kernel: type, check: str, message: str
) -> None:
    with pytest.raises(ConformanceError) as info:
        check_kernel(_spec(kernel), max_examples=30, checks=(check,))
    assert info.value.check == check
    assert re.search(message, str(info.value)), str(info.value)


def test_nan_within_its_own_problem_is_allowed() -> None:
    report = check_kernel(
        _spec(PoisonsItsProblems), max_examples=30, checks=("non-finite", "non-finite-gradients")
    )
    assert report.passed == ("non-finite", "non-finite-gradients")


class LseSlightlyOff(ReferenceKernel):
    """An lse off by a relative ``DELTA[dtype]`` (within the forward's tolerance) and a backward
    that is right given that lse: its gradients are wrong, and its own forward must not widen
    the gradient check's allowance."""

    DELTA: ClassVar[dict[torch.dtype, float]] = {
        torch.float32: 3e-6,
        torch.float16: 1e-3,
        torch.bfloat16: 1e-2,
    }

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        out, lse = super().forward(q, k, v, options)
        shift = self.DELTA[q.dtype] * lse.abs().clamp(min=1)
        return out, torch.where(torch.isfinite(lse), lse + shift, lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_a_slightly_wrong_lse_is_caught_by_the_gradients(dtype: torch.dtype) -> None:
    spec = _spec(LseSlightlyOff, frozenset({dtype}))
    with pytest.raises(ConformanceError) as info:
        check_kernel(spec, max_examples=30, checks=("gradients",))
    assert info.value.check == "gradients"


def test_the_kit_rejects_a_backward_that_weights_a_merged_infinite_lse_by_zero() -> None:
    """A flash-style backward computes P = exp(s - lse): handed a merged lse of +inf (another
    block's infinite score), it weights the row by zero and returns finite dv where the exact
    math is NaN; its own inputs are finite, so a repair keyed on them misses it. The kit hands
    every kernel such an lse (a review found the kit passing this kernel)."""
    import attrs as _attrs

    from ringdilated.backends import _dense
    from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
    from ringdilated.core.contract.kernel import mark_non_finite_problems
    from ringdilated.testing.conformance import ConformanceError, check_kernel

    class ZeroWeight(ReferenceKernel):
        def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
            finite = torch.where(torch.isposinf(lse), torch.full_like(lse, 1e30), lse)
            dq, dk, dv = _dense.backward(dout, q, k, v, out, finite, options, None)
            mark_non_finite_problems(dq, dk, dv, dout, q, k, v, torch.zeros_like(lse))
            return dq, dk, dv

    spec = _attrs.evolve(REFERENCE_SPEC, name="zero-weight", factory=ZeroWeight)
    with pytest.raises(ConformanceError, match="merged lse of inf"):
        check_kernel(spec, checks=("non-finite-gradients",), max_examples=40)


def test_the_dropout_check_applies_where_a_target_serves_dropout() -> None:
    """Per target and device: sdpa's CPU op has none, its CUDA op has it; a spec with one CPU
    target without dropout beside one with it is checked (on the dtype that serves it)."""
    from ringdilated.backends.sdpa import SDPA_SPEC
    from ringdilated.core import Environment
    from ringdilated.testing import applicable_checks

    assert "dropout" not in applicable_checks(SDPA_SPEC, "cpu")
    ampere = Environment(packages=frozenset(), compute_capability=(8, 0))
    assert "dropout" in applicable_checks(SDPA_SPEC, "cuda", ampere)
    mixed = attrs.evolve(
        REFERENCE_SPEC.capabilities,
        targets=(
            Target("cpu", frozenset({torch.float32}), dropout=False),
            Target("cpu", frozenset({torch.float64})),
        ),
    )
    spec = KernelSpec(name="mixed", factory=ReferenceKernel, capabilities=mixed)
    assert "dropout" in applicable_checks(spec, "cpu")
    none = attrs.evolve(mixed, targets=mixed.targets[:1])
    assert "dropout" not in applicable_checks(attrs.evolve(spec, capabilities=none), "cpu")
