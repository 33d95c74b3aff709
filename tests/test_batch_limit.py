"""Kernels that put the batch in a CUDA grid dimension (capped at 65535) declare a BatchLimit;
the driver never hands them a call with more problems, and the result is still exact."""

from __future__ import annotations

import attrs
import pytest
import torch

from ringdilated.backends.local import LOCAL_SPEC
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.core import KernelSpec, KeyWindow, Resolver
from ringdilated.core.contract.kernel import BlockOptions
from ringdilated.core.plan.pattern import DilationPattern
from ringdilated.core.plan.window import CAUSAL
from ringdilated.core.run.local import (
    BatchLimitedKernel,
    CallState,
    DilatedAttentionFunction,
    pattern_run,
)
from ringdilated.core.select.capabilities import BatchLimit
from ringdilated.functional import attend
from ringdilated.testing import oracle


class SpyKernel(ReferenceKernel):
    """The reference kernel, recording the largest problem count and count x kv heads."""

    def __init__(self) -> None:
        self.most = 0
        self.most_x_heads = 0

    def _see(self, k: torch.Tensor) -> None:
        self.most = max(self.most, k.shape[0])
        self.most_x_heads = max(self.most_x_heads, k.shape[0] * k.shape[1])

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        self._see(k)
        return super().forward(q, k, v, options)

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        self._see(k)
        return super().backward(dout, q, k, v, out, lse, options)


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(3, 64, 4, 8, generator=g, dtype=torch.float64).requires_grad_()
    k = torch.randn(3, 64, 2, 8, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(3, 64, 2, 8, generator=g, dtype=torch.float64).requires_grad_()
    return q, k, v


@pytest.mark.parametrize(
    ("limit", "most", "most_x_heads"),
    [(BatchLimit(problems=5), 5, None), (BatchLimit(problems_x_kv_heads=6), None, 6)],
)
@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_no_call_exceeds_the_declared_limit_and_results_stay_exact(
    limit: BatchLimit, most: int | None, most_x_heads: int | None, mode: str
) -> None:
    """Segments of 4 over 64 positions and a batch of 3: 48 problems per block unsplit."""
    pattern = DilationPattern([4, 16], [1, 2], mode)  # type: ignore[arg-type]
    spy = SpyKernel()
    q, k, v = _inputs()
    run = pattern_run(
        spy, pattern, q, k, window=CAUSAL, scale=None, dropout_p=0.0,
        batch_limit=limit,
    )  # fmt: skip
    out, _ = DilatedAttentionFunction.apply(q, k, v, run, CallState())
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    assert spy.most <= (most or 48) and spy.most_x_heads <= (most_x_heads or 96)
    assert spy.most < 48, "the limit split the calls"
    expected = oracle(q, k, v, [4, 16], [1, 2], mode=mode, causal=True)
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)
    expected_grads = torch.autograd.grad(expected, (q, k, v), dout)
    for a, e in zip(grads, expected_grads, strict=True):
        assert torch.allclose(a, e, atol=1e-12, rtol=0)


def test_the_resolvers_plan_carries_the_limit_into_the_call() -> None:
    spy = SpyKernel()
    spec = KernelSpec(
        name="spy",
        factory=lambda: spy,
        capabilities=attrs.evolve(REFERENCE_SPEC.capabilities, batch_limit=BatchLimit(problems=4)),
    )
    resolver = Resolver([spec], communicators=(LOCAL_SPEC,))
    q, k, v = _inputs(1)
    pattern = DilationPattern([4], [1])
    out, _, plan = attend(
        pattern, q, k, v, causal=False, scale=None, dropout_p=0.0, kernel="spy", resolver=resolver
    )
    assert plan is not None and plan.kernel.batch_limit == BatchLimit(problems=4)
    assert 0 < spy.most <= 4
    assert torch.allclose(out, oracle(q, k, v, [4], [1]), atol=1e-12, rtol=0)


def test_batch_limited_kernel_splits_what_the_driver_cannot() -> None:
    """A sharded run's crossing pieces hold one problem per batch row."""
    spy = SpyKernel()
    limited = BatchLimitedKernel(spy, BatchLimit(problems=2))
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(5, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(3))
    options = BlockOptions(scale=0.4, window=KeyWindow(None, 1))
    out, lse = limited.forward(q, k, v, options)
    whole_out, whole_lse = ReferenceKernel().forward(q, k, v, options)
    assert torch.equal(out, whole_out) and torch.equal(lse, whole_lse)
    dout = torch.randn(q.shape, generator=g, dtype=torch.float64)
    grads = limited.backward(dout, q, k, v, out, lse, options)
    whole = ReferenceKernel().backward(dout, q, k, v, out, lse, options)
    for a, b in zip(grads, whole, strict=True):
        assert torch.allclose(a, b, atol=1e-14, rtol=0)
    assert spy.most == 2


def test_the_cuda_kernels_declare_the_grid_limit() -> None:
    from ringdilated.backends.flash import FLASH_SPEC
    from ringdilated.backends.flex import FLEX_SPEC
    from ringdilated.backends.sdpa import SDPA_SPEC
    from ringdilated.backends.xformers import XFORMERS_SPEC

    for spec in (FLASH_SPEC, SDPA_SPEC, XFORMERS_SPEC):
        assert spec.capabilities.batch_limit.per_call(1) == 65535, spec.name
    # flex's decoding kernel puts batch x kv heads in one grid dimension.
    assert FLEX_SPEC.capabilities.batch_limit.per_call(8) == 65535 // 8


def test_the_compiled_path_honours_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringdilated import DilatedAttention
    from ringdilated.functional import default_resolver

    spy = SpyKernel()
    spec = KernelSpec(
        name="spy",
        factory=lambda: spy,
        capabilities=attrs.evolve(REFERENCE_SPEC.capabilities, batch_limit=BatchLimit(problems=3)),
    )
    resolver = default_resolver()
    monkeypatch.setitem(resolver.specs, "spy", spec)
    monkeypatch.setitem(resolver._kernels, "spy", spy)
    torch._dynamo.reset()
    attn = torch.compile(
        DilatedAttention([4, 16], [1, 2], kernel="spy"), fullgraph=True, backend="aot_eager"
    )
    q, k, v = _inputs(3)
    out = attn(q, k, v)
    torch.autograd.grad(out.sum(), (q, k, v))
    assert 0 < spy.most <= 3
    assert torch.allclose(out, oracle(q, k, v, [4, 16], [1, 2]), atol=1e-12, rtol=0)
    torch._dynamo.reset()


def test_a_sharded_run_splits_its_crossing_calls(workers2: object) -> None:
    results = workers2.results("tests.fault_tasks:batch_limited_shards", {})  # type: ignore[attr-defined]
    for result in results:
        assert result["most"] == 1, result
        assert result["error"] < 1e-12, result


def test_split_calls_draw_their_own_dropout_masks() -> None:
    """Pieces of one shape must not repeat a mask; forward and backward must agree."""
    limited = BatchLimitedKernel(ReferenceKernel(), BatchLimit(problems=1))
    v = torch.eye(6, dtype=torch.float64).expand(2, 1, 6, 6).contiguous()
    q = torch.zeros(2, 1, 6, 6, dtype=torch.float64)
    options = BlockOptions(scale=1.0, dropout_p=0.5, dropout_seed=11)
    out, lse = limited.forward(q, q, v, options)  # v = identity: out rows are the kept weights
    assert not torch.equal(out[0], out[1]), "each piece drew its own mask"
    dout = torch.randn(out.shape, dtype=torch.float64)
    _, _, dv = limited.backward(dout, q, q, v, out, lse, options)
    kept = (out != 0).to(torch.float64)  # the forward's masks, per piece
    expected_dv = torch.matmul((kept / 0.5 / 6).transpose(-1, -2), dout)
    assert torch.allclose(dv, expected_dv, atol=1e-12), "backward regenerated the same masks"
