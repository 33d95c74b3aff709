"""A problem larger than a kernel's ``BatchLimit.query_elements`` is split along its query rows
(``ringdilated.core.run.limited``): by the single-process driver (each row chunk a step) and by
``BatchLimitedKernel`` (a sharded run's crossing pieces). Every result here is judged against
the float64 oracle (or the conformance kit, which is), with a bound small enough that every
block splits; the call counts at L = 2^20 are in tests/test_fused_chunking.py."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch

from ringdilated.backends.local import LOCAL_SPEC
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.backends.sdpa import SdpaKernel
from ringdilated.core import Capabilities, KernelSpec, KeyWindow, Resolver, Target
from ringdilated.core.contract.kernel import BlockOptions, Kernel
from ringdilated.core.run.limited import BatchLimitedKernel, RowChunk, row_chunks
from ringdilated.core.select.capabilities import BatchLimit
from ringdilated.functional import attend
from ringdilated.testing import allowed_error, check_kernel, dense_attention, max_error, oracle
from ringdilated.testing.conformance import CHECKS
from ringdilated.testing.kernel_cases import CaseSpace

#: Query elements a call: at H = 4 heads of D = 8 (two a block in head_groups mode) a row of one
#: problem holds 16 or 32 of them, so every block of the patterns below splits into chunks of
#: one or two rows.
BOUND = 40


class Spy:
    """``kernel``, recording each call's problems, query rows and query elements."""

    def __init__(self, kernel: Kernel) -> None:
        self.kernel = kernel
        self.calls: list[tuple[int, int, int]] = []

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        self.calls.append((q.shape[0], q.shape[2], q.numel()))
        return self.kernel.forward(q, k, v, options)

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        self.calls.append((q.shape[0], q.shape[2], q.numel()))
        return self.kernel.backward(dout, q, k, v, out, lse, options)


def test_row_chunks_tile_the_rows_and_shift_the_window() -> None:
    """Worked by hand: 10 rows of 6 elements within 20 a chunk are chunks of 3 rows (the last
    of 1); query ``i`` of a chunk at row ``r`` is row ``r + i``, so a right bound of 2 becomes
    ``2 + r`` and a left bound of 4 ``4 - r``."""
    options = BlockOptions(0.5, KeyWindow(4, 2))
    chunks = list(row_chunks(10, 6, 20, options))
    assert [(c.start, c.stop) for c in chunks] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [c.options.window for c in chunks] == [
        KeyWindow(4, 2), KeyWindow(1, 5), KeyWindow(-2, 8), KeyWindow(-5, 11)
    ]  # fmt: skip
    assert list(row_chunks(10, 6, 60, options)) == [RowChunk(0, 10, options)]
    assert list(row_chunks(10, 6, None, options)) == [RowChunk(0, 10, options)]
    assert len(list(row_chunks(10, 6, 1, options))) == 10, "one row at least"


def _spec(kernel: Kernel, bound: int, dropout: bool = False) -> KernelSpec:
    """``kernel`` on float64 CPU tensors, at most ``bound`` query elements a call."""
    return KernelSpec(
        name="bounded",
        factory=lambda: kernel,
        capabilities=Capabilities(
            targets=(Target("cpu", frozenset({torch.float64})),),
            dropout=dropout,
            batch_limit=BatchLimit(query_elements=bound),
        ),
    )


@pytest.mark.parametrize("make", [ReferenceKernel, SdpaKernel], ids=["reference", "sdpa"])
@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
@pytest.mark.parametrize(("q_len", "causal"), [(32, True), (32, False), (12, True)])
def test_rows_split_by_the_bound_stay_exact(
    make: type, mode: str, q_len: int, causal: bool
) -> None:
    """Forward and backward of ``out`` and of ``lse`` (``return_lse``: its gradient runs the lse
    path of every chunk) against the float64 oracle, with grouped heads (4 query heads on 2
    key/value heads), causal or not, and a query suffix of 12 rows over 32 keys (decoding);
    every call within the bound, as whole rows."""
    spy = Spy(make())
    resolver = Resolver([_spec(spy, BOUND)], communicators=(LOCAL_SPEC,))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(11)
    q = torch.randn(2, q_len, 4, 8, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (
        torch.randn(2, 32, 2, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in "kv"
    )
    pattern = ([8, 16], [1, 2])
    out, lse, _ = attend(
        (*pattern, mode), q, k, v, causal=causal, scale=None, dropout_p=0.0, kernel="bounded",
        resolver=resolver, return_lse=True, full_precision_lse=True,
    )  # fmt: skip
    expected, expected_lse = oracle(q, k, v, *pattern, mode=mode, causal=causal, return_lse=True)
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)
    assert torch.allclose(lse, expected_lse, atol=1e-12, rtol=0)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    seen = lse.isfinite()  # rows that see no key: lse = -inf on both sides, no gradient
    grads = torch.autograd.grad((out * dout).sum() + (lse * dlse)[seen].sum(), (q, k, v))
    wanted = (expected * dout).sum() + (expected_lse * dlse)[seen].sum()
    for name, got, want in zip("qkv", grads, torch.autograd.grad(wanted, (q, k, v)), strict=True):
        assert torch.allclose(got, want, atol=1e-11, rtol=0), f"d{name}"
    assert max(rows for _, rows, _ in spy.calls) <= 2
    assert max(elements for _, _, elements in spy.calls) <= BOUND


def test_the_kit_passes_a_kernel_split_by_rows() -> None:
    """The conformance kit, every check (dropout included: each row chunk draws its own mask,
    which the kit reads back, checks for rate and seed, and holds the backward to), on the
    reference kernel behind :class:`BatchLimitedKernel` with a bound of 256 query elements: the
    kit's problems (up to 24 rows; head dims up to 16, so a piece holds a few rows) split by
    problems and rows."""
    inner = Spy(ReferenceKernel())
    outer = Spy(BatchLimitedKernel(inner, BatchLimit(query_elements=256)))  # type: ignore[arg-type]
    spec = attrs.evolve(REFERENCE_SPEC, name="rows", factory=lambda: outer)
    report = check_kernel(spec, max_examples=12, space=CaseSpace(max_len=24, max_head_dim=16))
    assert report.passed == CHECKS
    # One problem beyond the bound (so split by its rows: every inner call is within it).
    assert any(n == 1 and elements > 256 for n, _, elements in outer.calls)
    # Within the bound, or one row of one problem (a call holds one at least).
    assert all(elements <= 256 or (n, rows) == (1, 1) for n, rows, elements in inner.calls)
    assert max(elements for _, _, elements in outer.calls) > 256


def test_row_chunks_of_a_crossing_piece_draw_their_own_masks() -> None:
    """:class:`BatchLimitedKernel` with 2 rows a call: the 4 row chunks of one problem (equal
    shapes, so one seed for all would draw one mask 4 times) draw 4 masks, and the backward
    replays them: with ``v`` the identity, ``out`` is the kept weights and ``dv`` must be their
    transpose times ``dout``, chunk by chunk."""
    limited = BatchLimitedKernel(ReferenceKernel(), BatchLimit(query_elements=16))
    q = torch.zeros(1, 1, 8, 8, dtype=torch.float64)  # uniform probabilities, 1/8 each
    v = torch.eye(8, dtype=torch.float64).view(1, 1, 8, 8)
    options = BlockOptions(scale=1.0, dropout_p=0.5, dropout_seed=11)
    out, lse = limited.forward(q, q, v, options)
    kept = (out[0, 0] != 0).double()
    assert torch.allclose(out[0, 0], kept / 0.5 / 8, atol=1e-15, rtol=0)
    chunks = kept.view(4, 2, 8)  # (chunks, rows, keys)
    assert all(not torch.equal(chunks[0], chunks[i]) for i in range(1, 4)), "4 masks"
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    _, _, dv = limited.backward(dout, q, q, v, out, lse, options)
    assert torch.allclose(dv, out.transpose(-1, -2) @ dout, atol=1e-12, rtol=0), "replayed"


def _dropout_inputs(causal: bool) -> tuple[torch.Tensor, ...]:
    """One segment of 16 positions, 2 query heads on 1 key/value head, D = 16, and ``v`` whose
    key ``j`` is the unit vector ``j``: row ``i`` of head ``h`` of ``out`` is then the dropped
    probabilities of that query. Zero queries (uniform probabilities) when not causal, so equal
    masks would show as equal rows."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 16, 2, 16, generator=g, dtype=torch.float64) * (0.5 if causal else 0.0)
    k = torch.randn(1, 16, 1, 16, generator=g, dtype=torch.float64) * 0.5
    v = torch.eye(16, dtype=torch.float64).view(1, 16, 1, 16)
    return q.requires_grad_(), k.requires_grad_(), v.clone().requires_grad_()


def _probabilities(q: torch.Tensor, k: torch.Tensor, causal: bool) -> torch.Tensor:
    """float64 ``(H, Lq, Lk)`` probabilities of one segment, differentiable."""
    scores = torch.einsum("qhd,kd->hqk", q[0], k[0, :, 0]) / 4.0
    if causal:
        scores = scores.masked_fill(torch.ones(16, 16).triu(1).bool(), float("-inf"))
    return scores.softmax(-1)


@pytest.mark.parametrize("causal", [True, False])
def test_dropout_of_split_rows_is_replayed_by_the_backward(causal: bool) -> None:
    """Through the driver, rows in chunks of 2 (each chunk a step with a seed of its own): the
    mask read back from the forward keeps each probability whole or drops it, at about the
    rate asked, differs between chunks (one seed for all would repeat one pattern in every
    chunk of this shape), and the backward's gradients are float64 autograd's under that very
    mask (a backward drawing other masks fails)."""
    p = 0.5
    spec = _spec(ReferenceKernel(), 64, dropout=True)  # 2 heads x D = 16: 2 rows a call
    resolver = Resolver([spec], communicators=(LOCAL_SPEC,))
    q, k, v = _dropout_inputs(causal)
    torch.manual_seed(21)
    out, _, _ = attend(
        ([16], [1]), q, k, v, causal=causal, scale=0.25, dropout_p=p, kernel="bounded",
        resolver=resolver,
    )  # fmt: skip
    weights = out[0].detach().transpose(0, 1)  # (H, Lq, Lk): the dropped probabilities
    probabilities = _probabilities(q.detach(), k.detach(), causal)
    keep = weights > probabilities / (1 - p) / 2
    assert torch.allclose(weights, probabilities * keep / (1 - p), atol=1e-12, rtol=0)
    visible = probabilities > 0
    rate = float(keep[visible].double().mean())
    assert abs(rate - (1 - p)) < 0.15, f"kept {rate:.2f}"
    if not causal:
        chunks = keep.view(2, 8, 2, 16)  # (heads, chunks of 2 rows, rows, keys)
        assert all(not torch.equal(chunks[:, 0], chunks[:, i]) for i in range(1, 8))
    dout = torch.randn(out.shape, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    exact = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    dropped = _probabilities(exact[0], exact[1], causal) * keep / (1 - p)
    expected = torch.einsum("hqk,kd->qhd", dropped, exact[2][0, :, 0]).unsqueeze(0)
    for name, got, want in zip(
        "qkv", grads, torch.autograd.grad(expected, exact, dout), strict=True
    ):
        assert torch.allclose(got, want, atol=1e-12, rtol=0), f"d{name} under the forward's mask"


@pytest.mark.parametrize("bound", [40, 1 << 23])
def test_a_sharded_run_splits_crossing_rows(workers2: Any, bound: int) -> None:
    """Two gloo ranks, shards of 16: the 32-segment crosses the boundary, so its pieces (a
    rank's rows of the segment, one problem per batch row) go through ``BatchLimitedKernel``.
    With a bound of 40 every call is at most 2 rows (the inner 16-segments' too); with the
    default bound the inner blocks run whole (16 rows). ``out``, ``lse`` and the gradients
    (through ``out`` and the lse, causal, grouped heads) match the oracle either way."""
    results = workers2.results("tests.fault_tasks:row_limited_shards", {"bound": bound})
    for result in results:
        assert max(result["errors"]) < 1e-12 and result["same_lse_rows"], result
        assert result["rows"] == (2 if bound == 40 else 16), result
        assert result["elements"] <= bound, result


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_rows_split_in_bfloat16_stay_within_the_tolerance_rule(mode: str) -> None:
    """In bfloat16 each row chunk's ``dk``, ``dv`` is rounded by the kernel before the chunks
    are summed (in float32): ``out`` and the gradients of ``out`` and the lse stay within the
    tolerance rule against the float64 oracle (a plain dense bfloat16 computation the
    baseline), split to 2 rows a call."""
    spy = Spy(ReferenceKernel())
    spec = attrs.evolve(
        _spec(spy, BOUND),
        capabilities=attrs.evolve(
            _spec(spy, BOUND).capabilities,
            targets=(Target("cpu", frozenset({torch.bfloat16})),),
        ),
    )
    resolver = Resolver([spec], communicators=(LOCAL_SPEC,))  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(12)
    exact = [
        torch.randn(2, 32, h, 8, generator=g, dtype=torch.float64).requires_grad_()
        for h in (4, 2, 2)
    ]
    low = [x.detach().bfloat16().requires_grad_() for x in exact]
    pattern = ([8, 16], [1, 2])
    out, lse, _ = attend(
        (*pattern, mode), *low, causal=True, scale=None, dropout_p=0.0, kernel="bounded",
        resolver=resolver, return_lse=True, full_precision_lse=True,
    )  # fmt: skip
    assert max(rows for _, rows, _ in spy.calls) <= 2
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)

    def loss(o: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (o.double() * dout).sum() + (s.double() * dlse).sum()

    expected = oracle(*exact, *pattern, mode=mode, causal=True, return_lse=True)
    base = dense_attention(*low, *pattern, mode=mode, causal=True)
    assert max_error(out, expected[0]) <= allowed_error(expected[0], base[0], torch.bfloat16)
    got = torch.autograd.grad(loss(out, lse), low)
    wanted = torch.autograd.grad(loss(*expected), exact)
    baseline = torch.autograd.grad(loss(*base), low)
    for name, a, e, b in zip("qkv", got, wanted, baseline, strict=True):
        error, allowed = max_error(a, e), allowed_error(e, b, torch.bfloat16)
        assert error <= allowed, f"d{name}: {error:.3g} > {allowed:.3g}"
