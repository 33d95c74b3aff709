"""Small kernel calls of one shape run as one call (issue 20, item 6): fewer kernel calls,
results that match the float64 oracle as the separate calls' do, forward and backward, on every
path that writes results (copies, merges, lse gradients), with documents, padding and keys that
are not contiguous."""

from __future__ import annotations

import pytest
import torch

import ringdilated
from ringdilated.backends.reference import ReferenceKernel
from ringdilated.core.plan.pattern import DilationPattern
from ringdilated.core.plan.window import FULL
from ringdilated.core.run import local as driver
from ringdilated.core.run.local import CallState, DilatedAttentionFunction, pattern_run
from ringdilated.testing import oracle

SEGMENTS, RATES = [16, 32, 64], [1, 2, 4]


class CountingKernel(ReferenceKernel):
    """The reference kernel, counting its calls and the problems each call holds."""

    def __init__(self) -> None:
        self.forwards: list[int] = []
        self.backwards: list[int] = []

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        self.forwards.append(q.shape[0])
        return super().forward(q, k, v, options)

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        self.backwards.append(q.shape[0])
        return super().backward(dout, q, k, v, out, lse, options)


def _inputs(
    batch: int, length: int, heads: int, kv_heads: int, *, strided_kv: bool = False, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, length, heads, 8, generator=g, dtype=torch.float64)
    if strided_kv:  # (B, Hkv, L, D) transposed: k and v are not contiguous (read in place)
        shape = (batch, kv_heads, length, 8)
        k, v = (
            torch.randn(shape, generator=g, dtype=torch.float64).transpose(1, 2) for _ in range(2)
        )
    else:
        k, v = (
            torch.randn(batch, length, kv_heads, 8, generator=g, dtype=torch.float64)
            for _ in range(2)
        )
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_()


def _check(
    kernel: CountingKernel,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    mode: str = "head_groups",
    causal: bool = False,
    **documents: torch.Tensor,
) -> None:
    """Output, lse and gradients (through the lse too) against the float64 oracle."""
    out, lse = ringdilated.dilated_attention(
        q, k, v, SEGMENTS, RATES, mode=mode, causal=causal, kernel=kernel,  # type: ignore[arg-type]
        return_lse=True, **documents,
    )  # fmt: skip
    expected, expected_lse = oracle(
        q, k, v, SEGMENTS, RATES, mode=mode, causal=causal, return_lse=True, **documents
    )
    g = torch.Generator().manual_seed(7)
    dout = torch.randn(out.shape, generator=g, dtype=out.dtype)
    dlse = torch.randn(lse.shape, generator=g, dtype=lse.dtype)
    seen = torch.isfinite(expected_lse)  # rows that see no key: lse -inf, no gradient through it
    loss = (out * dout).sum() + (lse.masked_fill(~seen, 0) * dlse).sum()
    expected_loss = (expected * dout).sum() + (expected_lse.masked_fill(~seen, 0) * dlse).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    expected_grads = torch.autograd.grad(expected_loss, (q, k, v))
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)
    assert torch.equal(lse[~seen], expected_lse[~seen].float())
    assert torch.allclose(lse[seen].double(), expected_lse[seen], atol=1e-5, rtol=0)
    for name, a, e in zip("qkv", grads, expected_grads, strict=True):
        assert torch.allclose(a, e, atol=1e-5, rtol=0), name


def test_the_issues_configuration_makes_one_kernel_call_each_way() -> None:
    """L=64, three patterns whose blocks all hold 16 positions: one call, not three."""
    kernel = CountingKernel()
    q, k, v = _inputs(1, 64, 3, 3)
    out = ringdilated.dilated_attention(q, k, v, SEGMENTS, RATES, kernel=kernel)  # type: ignore[arg-type]
    out.backward(torch.ones_like(out))
    assert kernel.forwards == [4 + 2 + 1] and kernel.backwards == [4 + 2 + 1]
    expected = oracle(q, k, v, SEGMENTS, RATES)
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("strided_kv", [False, True])
def test_fused_and_separate_calls_both_match_the_oracle(
    mode: str, causal: bool, strided_kv: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    batch = 1 if strided_kv else 2  # one batch row: k and v are read through their strides
    inputs = _inputs(batch, 64, 6, 3, strided_kv=strided_kv)
    fused = CountingKernel()
    _check(fused, *inputs, mode=mode, causal=causal)
    monkeypatch.setattr(driver, "FUSE_ELEMENTS", 0)
    separate = CountingKernel()
    _check(separate, *inputs, mode=mode, causal=causal)
    assert sum(fused.forwards) == sum(separate.forwards)
    assert len(fused.forwards) < len(separate.forwards), (fused.forwards, separate.forwards)


def test_documents_and_padding_fuse_and_stay_exact() -> None:
    kernel = CountingKernel()
    q, k, v = _inputs(1, 128, 3, 3, seed=1)
    _check(kernel, q, k, v, causal=True, cu_seqlens=torch.tensor([0, 40, 64, 100, 128]))
    assert len(kernel.forwards) > 0
    kernel = CountingKernel()
    q, k, v = _inputs(2, 64, 3, 3, seed=2)
    mask = torch.ones(2, 64, dtype=torch.bool)
    mask[1, 50:] = False
    _check(kernel, q, k, v, mode="longnet", key_padding_mask=mask)


def test_calls_with_dropout_are_never_fused() -> None:
    """Each step draws its own dropout mask from its own seed: fusing would change the masks."""
    kernel = CountingKernel()
    q, k, v = (x.detach() for x in _inputs(1, 64, 3, 3))
    run = pattern_run(
        kernel, DilationPattern(SEGMENTS, RATES), q, k, window=FULL, scale=None, dropout_p=0.5
    )
    with torch.no_grad():
        DilatedAttentionFunction.apply(q, k, v, run, CallState(seed=3))
    assert kernel.forwards == [4, 2, 1]


def test_a_large_step_reads_its_views_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above FUSE_ELEMENTS a step runs alone, on strided views of the caller's tensors."""
    monkeypatch.setattr(driver, "FUSE_ELEMENTS", 2 * 16 * 8 - 1)  # fuses no two of the steps
    views: list[bool] = []

    class ViewSpy(CountingKernel):
        def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
            views.append(q._base is not None and k._base is not None)
            return super().forward(q, k, v, options)

    kernel = ViewSpy()
    _check(kernel, *_inputs(1, 64, 3, 3))
    assert views == [True, True, True] and kernel.forwards == [4, 2, 1]


def test_fused_calls_run_under_deterministic_algorithms() -> None:
    """Their writes use index_put_ (deterministic), not put_ (which torch refuses then)."""
    kernel = CountingKernel()
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        _check(kernel, *_inputs(1, 64, 3, 3))
    finally:
        torch.use_deterministic_algorithms(before)
    assert kernel.forwards == [7]


def test_a_query_suffix_reads_its_keys_in_place() -> None:
    """Decoding: one query against a long cache. Its steps are small in q but not in k and v,
    so they are not fused (fusing would copy the cache every call); a short cache's are."""
    views: list[bool] = []

    class ViewSpy(CountingKernel):
        def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
            views.append(k._base is not None and v._base is not None)
            return super().forward(q, k, v, options)

    g = torch.Generator().manual_seed(3)
    k, v = (
        torch.randn(1, 3, 8192, 8, generator=g, dtype=torch.float64).transpose(1, 2) for _ in "kv"
    )
    q = torch.randn(1, 1, 3, 8, generator=g, dtype=torch.float64)
    segments, rates = [2048, 4096, 8192], [1, 2, 4]  # each block: one head, 2048 keys
    with torch.no_grad():
        out = ringdilated.dilated_attention(
            q,
            k,
            v,
            segments,
            rates,
            causal=True,
            kernel=ViewSpy(),  # type: ignore[arg-type]
        )
    assert views and all(views), views
    expected = oracle(q, k, v, segments, rates, causal=True)
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)
    views.clear()
    short = [x[:, :512] for x in (k, v)]
    with torch.no_grad():
        out = ringdilated.dilated_attention(
            q,
            *short,
            [128, 256, 512],
            rates,
            causal=True,
            kernel=ViewSpy(),  # type: ignore[arg-type]
        )
    assert views == [False], views  # three steps of 128 keys: one call, gathered
    expected = oracle(q, *short, [128, 256, 512], rates, causal=True)
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)


def test_row_offsets_are_the_rows_each_view_reads() -> None:
    """The index of a fused call lists, in order, the storage offset of every row of every
    step's view (checked against the views themselves)."""
    from ringdilated.core.run.local import StridedView, _row_offsets

    storage = torch.arange(4 * 48 * 6 * 8)  # each element holds its own offset
    views = [
        StridedView((3, 2, 5, 8), (48 * 6 * 8, 8, 2 * 6 * 8, 1), 16),
        StridedView((1, 2, 5, 8), (48 * 6 * 8, 8, 2 * 6 * 8, 1), 3 * 48 * 6 * 8 + 24),
        StridedView((2, 2, 5, 8), (6 * 8, 8, 4 * 6 * 8, 1), 7),  # other strides: its own run
    ]
    index = _row_offsets(views, storage.device)
    expected = torch.cat([v.of(storage)[..., 0] for v in views])
    assert index.shape == (6, 2, 5) and torch.equal(index, expected)
