"""Kernel calls per forward follow the kernel's declared bound (issue 23): a kernel that
materialises scores keeps the default scratch bound (``DEFAULT_QUERY_ELEMENTS``, 8M query
elements a call); a fused kernel (``FUSED_GRID_LIMIT``: no scratch bound) is split by its launch
grid and its 2^28 query elements a call, so at L = 2^20 its calls drop to one or two a block; a
single segment larger than the bound is split by query rows.

The counts at L = 2^20 with H = 8 and D = 64 run on ``meta`` tensors: they hold no data, so the
driver's real calls (their number and shapes) cost nothing to make. The expected counts are
worked out here from the pattern's blocks (whole segments a call), not read from the driver."""

from __future__ import annotations

import math

import attrs
import pytest
import torch

from ringdilated.backends.local import LOCAL_SPEC
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.core import Capabilities, KernelSpec, Resolver, Target
from ringdilated.core.contract.kernel import BlockOptions
from ringdilated.core.plan.pattern import Block, DilationPattern
from ringdilated.core.plan.window import CAUSAL, KeyWindow
from ringdilated.core.run.local import (
    BackwardInputs,
    BatchLimitedKernel,
    CallState,
    pattern_run,
)
from ringdilated.core.select.capabilities import (
    DEFAULT_QUERY_ELEMENTS,
    FUSED_GRID_LIMIT,
    FUSED_QUERY_ELEMENTS,
    GRID_LIMIT,
    UNLIMITED,
    BatchLimit,
)
from ringdilated.functional import attend
from ringdilated.testing import oracle

L, H, D = 1 << 20, 8, 64
#: bench_dilated's pattern (docs/benchmarks.md) and LongNet's published one (bench_distributed).
PATTERNS = {
    "bench": ((2048, 4096, 8192), (1, 2, 4)),
    "longnet-paper": ((2048, 4096, 8192, 16384, 32768), (1, 2, 4, 6, 12)),
}


class ShapeKernel:
    """Records each call's problem count ``N`` and query elements; returns zeros (and an lse of
    ``-inf``) of the contract's shapes and dtypes, so on ``meta`` tensors nothing is computed."""

    def __init__(self) -> None:
        self.forwards: list[tuple[int, int]] = []
        self.backwards: list[tuple[int, int]] = []

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.forwards.append((q.shape[0], q.numel()))
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        return out, torch.full(q.shape[:3], -math.inf, dtype=torch.float32, device=q.device)

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        self.backwards.append((q.shape[0], q.numel()))
        return tuple(torch.zeros(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v))  # type: ignore[return-value]


def _meta(batch: int, length: int, heads: int, kv_heads: int) -> tuple[torch.Tensor, ...]:
    q = torch.empty(batch, length, heads, D, device="meta")
    k, v = (torch.empty(batch, length, kv_heads, D, device="meta") for _ in "kv")
    return q, k, v


def _run_both_ways(
    pattern: DilationPattern,
    limit: BatchLimit,
    batch: int = 1,
    kv_heads: int = H,
    length: int = L,
) -> ShapeKernel:
    """One forward and one backward of ``pattern`` over ``(batch, L, H, D)`` meta tensors, causal,
    on a :class:`ShapeKernel` declared with ``limit``."""
    kernel = ShapeKernel()
    q, k, v = _meta(batch, length, H, kv_heads)
    run = pattern_run(
        kernel, pattern, q, k, window=CAUSAL, scale=None, dropout_p=0.0, batch_limit=limit
    )
    out, lse = run.forward(q, k, v, CallState())
    run.backward(BackwardInputs(torch.empty_like(out), None, q, k, v, out, lse), CallState())
    return kernel


def _grid_calls(blocks: tuple[Block, ...], per_call: int) -> int:
    """Calls one sequence needs when only the grid bounds them: each block's segments (its
    problems), ``per_call`` a call."""
    return sum(-(-block.selection.num_segments // per_call) for block in blocks)


def _budget_calls(blocks: tuple[Block, ...], budget: int, per_call: int | None = None) -> int:
    """Calls one sequence needs when each holds at most ``budget`` query elements, in whole
    segments (of ``count x heads x D`` query elements each), and at most ``per_call``
    segments (the grid) when given."""
    calls = 0
    for block in blocks:
        per_segment = block.selection.count * block.heads.num_heads * D
        most = budget // per_segment if per_call is None else min(per_call, budget // per_segment)
        calls += -(-block.selection.num_segments // most)
    return calls


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
@pytest.mark.parametrize("name", sorted(PATTERNS))
def test_fused_calls_at_1m_are_what_the_grid_limit_requires(name: str, mode: str) -> None:
    """The issue's case: at L = 2^20 every block of these patterns holds at most 512 segments,
    far below the grid limit, so a fused kernel's calls are bounded by its 2^28 query elements
    only: one or two per block, forward and backward; one that keeps the default bound needs
    several per block (LongNet's published pattern in longnet mode: 22 calls against 134)."""
    segments, rates = PATTERNS[name]
    pattern = DilationPattern(segments, rates, mode)  # type: ignore[arg-type]
    blocks = pattern.blocks(L, H, H)
    fused = _run_both_ways(pattern, FUSED_GRID_LIMIT)
    assert FUSED_GRID_LIMIT.query_elements == FUSED_QUERY_ELEMENTS == 1 << 28
    expected = _budget_calls(blocks, FUSED_QUERY_ELEMENTS, GRID_LIMIT)
    assert _grid_calls(blocks, GRID_LIMIT) == len(blocks)  # the grid alone: one call a block
    assert len(blocks) <= expected <= 2 * len(blocks)
    assert len(fused.forwards) == expected and len(fused.backwards) == expected
    assert max(n for n, _ in fused.forwards) <= GRID_LIMIT
    assert max(e for _, e in fused.forwards + fused.backwards) <= FUSED_QUERY_ELEMENTS

    bounded = _run_both_ways(pattern, UNLIMITED)  # declares nothing: the default bound
    assert UNLIMITED.query_elements == DEFAULT_QUERY_ELEMENTS == 1 << 23
    assert UNLIMITED.bounds_scratch and not FUSED_GRID_LIMIT.bounds_scratch
    assert len(bounded.forwards) == _budget_calls(blocks, DEFAULT_QUERY_ELEMENTS)
    assert len(bounded.backwards) == len(bounded.forwards)
    assert max(e for _, e in bounded.forwards + bounded.backwards) <= DEFAULT_QUERY_ELEMENTS
    assert len(bounded.forwards) > 5 * len(fused.forwards)
    # Both hand the kernel every query element exactly once.
    assert sum(e for _, e in fused.forwards) == sum(e for _, e in bounded.forwards)


def test_the_headline_counts_for_longnets_pattern() -> None:
    """Worked by hand: longnet mode, H = 8, rates 1, 2, 4, 6, 12: 1 + 2 + 4 + 6 + 8 head runs
    (blocks). At 8M elements a call: 64 (2048-segments of 8 heads, 2^20 elements each: 8 a
    call, 512 in all) + 2 x 16 + 4 x 4 + 14 (rate 6: runs of 2, 1, 1, 2, 1, 1 heads, 23 or 47
    or 48 segments of 64 a call) + 8 = 134. At 2^28: the rate-1 block's 512 segments of 2^20
    elements take 2 calls (256 a call), every other block 1: 22."""
    pattern = DilationPattern(*PATTERNS["longnet-paper"], "longnet")  # type: ignore[arg-type]
    assert len(_run_both_ways(pattern, FUSED_GRID_LIMIT).forwards) == 22
    assert len(_run_both_ways(pattern, UNLIMITED).forwards) == 134


@pytest.mark.parametrize(
    ("limit", "kv_heads", "per_call"),
    [
        (FUSED_GRID_LIMIT, H, GRID_LIMIT),
        # flex's declaration: batch x kv heads share one grid dimension.
        (BatchLimit(problems=GRID_LIMIT, problems_x_kv_heads=GRID_LIMIT, query_elements=None), H,
         GRID_LIMIT // H),
        (BatchLimit(problems=GRID_LIMIT, problems_x_kv_heads=GRID_LIMIT, query_elements=None), 2,
         GRID_LIMIT // 2),
    ],
)  # fmt: skip
def test_the_grid_limit_binds_for_many_small_segments(
    limit: BatchLimit, kv_heads: int, per_call: int
) -> None:
    """Segments of 4 at L = 2^20: 262144 problems in one block, more than one call may hold."""
    pattern = DilationPattern([4], [1])
    kernel = _run_both_ways(pattern, limit, kv_heads=kv_heads)
    problems = [n for n, _ in kernel.forwards]
    assert sum(problems) == L // 4
    assert len(problems) == -(-(L // 4) // per_call)
    assert len(problems) == _grid_calls(pattern.blocks(L, H, H), per_call)
    assert max(problems) == per_call  # full calls, then the rest
    assert [n for n, _ in kernel.backwards] == problems
    bounded = _run_both_ways(pattern, UNLIMITED, kv_heads=kv_heads)
    # 4 x 8 x 64 = 2048 query elements a segment: 4096 segments a call, 64 calls.
    assert len(bounded.forwards) == (L // 4) // (DEFAULT_QUERY_ELEMENTS // (4 * H * D)) == 64


def test_batch_rows_share_a_fused_call() -> None:
    """Four rows of 2^18 positions, 2048-segments: 4 x 128 problems of 3 heads (2^28 / 4 query
    elements a row at most), one call a block; at 2^20 a row fills a call by itself."""
    pattern = DilationPattern(*PATTERNS["bench"])  # type: ignore[arg-type]
    kernel = _run_both_ways(pattern, FUSED_GRID_LIMIT, batch=4, length=L // 4)
    assert [n for n, _ in kernel.forwards] == [4 * 128, 4 * 64, 4 * 32]
    whole = _run_both_ways(pattern, FUSED_GRID_LIMIT, batch=4)
    assert [n for n, _ in whole.forwards] == [512] * 6 + [512]  # rows of 2^20: one a call
    assert max(e for _, e in whole.forwards) <= FUSED_QUERY_ELEMENTS


def test_the_resolvers_choice_carries_the_fused_bound_into_the_call() -> None:
    """Through the public path: a kernel declared with ``FUSED_GRID_LIMIT``, chosen by "auto",
    runs one call per block at L = 2^20; an explicit chunk budget still bounds it."""
    kernel = ShapeKernel()
    spec = KernelSpec(
        name="fusedshape",
        factory=lambda: kernel,
        capabilities=Capabilities(
            targets=(Target("meta", frozenset({torch.float32})),), batch_limit=FUSED_GRID_LIMIT
        ),
    )
    resolver = Resolver([spec], communicators=(LOCAL_SPEC,))
    pattern = DilationPattern(*PATTERNS["bench"], "longnet")  # type: ignore[arg-type]
    q, k, v = _meta(1, L, H, H)
    _, _, plan = attend(
        pattern, q, k, v, causal=True, scale=None, dropout_p=0.0, kernel="auto", resolver=resolver
    )
    assert plan is not None and plan.kernel.batch_limit == FUSED_GRID_LIMIT
    blocks = pattern.blocks(L, H, H)
    assert len(kernel.forwards) == _budget_calls(blocks, FUSED_QUERY_ELEMENTS, GRID_LIMIT) == 8


def test_a_targets_own_bound_replaces_the_kernels() -> None:
    """A kernel fused on one device and materialising scores on another (flex: compiled on
    CUDA, eager on CPU) declares the bound per target; the choice carries the serving one."""
    from ringdilated.backends.flex import FLEX_SPEC
    from ringdilated.core import Environment, Request

    env = Environment(packages=frozenset(), compute_capability=(8, 0))
    resolver = Resolver([FLEX_SPEC], env=env)
    cpu = resolver.resolve(Request(head_dim=16, backward=False), "flex")
    cuda = resolver.resolve(Request("cuda", torch.bfloat16, 64, (8, 0)), "flex")
    assert cpu.batch_limit.query_elements == DEFAULT_QUERY_ELEMENTS
    assert cuda.batch_limit.query_elements == FUSED_QUERY_ELEMENTS
    with pytest.raises(TypeError, match="batch_limit must be None or a BatchLimit, got 8"):
        Target("cpu", frozenset({torch.float32}), batch_limit=8)  # type: ignore[arg-type]


def test_an_explicit_chunk_budget_bounds_a_fused_kernel_too() -> None:
    """``LocalRun.chunk_elements`` replaces the declared bound (a caller capping memory)."""
    pattern = DilationPattern(*PATTERNS["bench"])  # type: ignore[arg-type]
    q, k, v = _meta(1, L, H, H)
    kernel = ShapeKernel()
    run = pattern_run(
        kernel, pattern, q, k, window=CAUSAL, scale=None, dropout_p=0.0,
        batch_limit=FUSED_GRID_LIMIT,
    )  # fmt: skip
    capped = attrs.evolve(run, chunk_elements=1 << 22)
    capped.forward(q, k, v, CallState())
    blocks = pattern.blocks(L, H, H)
    assert len(kernel.forwards) == _budget_calls(blocks, 1 << 22)
    assert max(e for _, e in kernel.forwards) <= 1 << 22


class SpyKernel(ReferenceKernel):
    """The reference kernel, recording each call's problems and query elements."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        self.calls.append((q.shape[0], q.numel()))
        return super().forward(q, k, v, options)

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        self.calls.append((q.shape[0], q.numel()))
        return super().backward(dout, q, k, v, out, lse, options)


@pytest.mark.parametrize(
    ("limit", "most_problems", "most_elements"),
    [
        (BatchLimit(query_elements=200), None, 200),  # a declared scratch bound, not the default
        (BatchLimit(problems=5, query_elements=None), 5, None),  # the grid only
        (BatchLimit(query_elements=None), None, None),  # nothing: one call a block and row run
    ],
)
@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_calls_split_by_the_declared_bound_stay_exact(
    limit: BatchLimit, most_problems: int | None, most_elements: int | None, mode: str
) -> None:
    """Float64 against the oracle, forward and backward, through the resolver's plan."""
    spy = SpyKernel()
    spec = KernelSpec(
        name="spy",
        factory=lambda: spy,
        capabilities=attrs.evolve(REFERENCE_SPEC.capabilities, batch_limit=limit),
    )
    resolver = Resolver([spec], communicators=(LOCAL_SPEC,))
    g = torch.Generator().manual_seed(5)
    q = torch.randn(3, 64, 4, 8, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (
        torch.randn(3, 64, 2, 8, generator=g, dtype=torch.float64).requires_grad_() for _ in "kv"
    )
    pattern = DilationPattern([4, 16], [1, 2], mode)  # type: ignore[arg-type]
    out, _, _ = attend(
        pattern, q, k, v, causal=True, scale=None, dropout_p=0.0, kernel="auto", resolver=resolver
    )
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = oracle(q, k, v, [4, 16], [1, 2], mode=mode, causal=True)
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)
    for a, e in zip(grads, torch.autograd.grad(expected, (q, k, v), dout), strict=True):
        assert torch.allclose(a, e, atol=1e-12, rtol=0)
    problems, elements = max(n for n, _ in spy.calls), max(e for _, e in spy.calls)
    if most_problems is not None:
        assert problems == most_problems
    if most_elements is not None:
        assert elements <= most_elements < 2 * elements  # as many whole segments as fit
    if limit.problems is None and limit.query_elements is None:
        # Every block's 3 rows x its segments in one call: 48 problems of the 4-segments.
        assert problems == 3 * 64 // 4


class RowKernel(ShapeKernel):
    """A :class:`ShapeKernel` that also records each call's query rows, key rows and window."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[int, int, KeyWindow]] = []

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        self.rows.append((q.shape[2], k.shape[2], options.window))
        return super().forward(q, k, v, options)


def test_one_segment_larger_than_the_bound_is_split_by_query_rows() -> None:
    """The case the grid and whole segments cannot bound: one segment of 2^20 positions with
    H = 32, D = 128 is one problem of 2^32 query elements, 16 times the fused bound. Worked by
    hand: 2^28 / (32 x 128) = 2^16 rows a call, so 16 calls forward and 16 backward, each of
    exactly 2^28 query elements against the keys its rows see (8 grouped key/value heads; call
    ``i`` the first ``2^16 x (i + 1)``), the causal window shifted to the call's first row:
    ``right = 2^16 x i`` for call ``i``."""
    heads, kv_heads, dim = 32, 8, 128
    q = torch.empty(1, L, heads, dim, device="meta")
    k, v = (torch.empty(1, L, kv_heads, dim, device="meta") for _ in "kv")
    kernel = RowKernel()
    run = pattern_run(
        kernel, DilationPattern([L], [1]), q, k, window=CAUSAL, scale=None, dropout_p=0.0,
        batch_limit=FUSED_GRID_LIMIT,
    )  # fmt: skip
    out, lse = run.forward(q, k, v, CallState())
    run.backward(BackwardInputs(torch.empty_like(out), None, q, k, v, out, lse), CallState())
    chunk = 1 << 16
    assert kernel.forwards == [(1, FUSED_QUERY_ELEMENTS)] * 16
    assert kernel.backwards == [(1, FUSED_QUERY_ELEMENTS)] * 16
    # Each call holds only the keys its rows see: up to its last row (a causal band's prefix).
    assert kernel.rows == [(chunk, chunk * (i + 1), KeyWindow(None, chunk * i)) for i in range(16)]


def test_the_crossing_path_splits_a_large_problem_by_rows_too() -> None:
    """:class:`BatchLimitedKernel` (a sharded run's crossing pieces): two problems of 32 heads,
    2^18 rows, D = 128 (2^30 query elements each) take 4 calls of 2^16 rows each, problem by
    problem; 40 problems of 2^23 elements take 32 and then 8 (the bound, by problems); 3 such
    problems fit one call, which goes through untouched."""
    kernel = RowKernel()
    limited = BatchLimitedKernel(kernel, FUSED_GRID_LIMIT)
    q = torch.empty(2, 32, 1 << 18, 128, device="meta")
    k = torch.empty(2, 8, 1 << 18, 128, device="meta")
    out, lse = limited.forward(q, k, k, BlockOptions(0.1, CAUSAL))
    limited.backward(out, q, k, k, out, lse, BlockOptions(0.1, CAUSAL))
    assert kernel.forwards == kernel.backwards == [(1, FUSED_QUERY_ELEMENTS)] * 8
    assert [window.right for _, _, window in kernel.rows] == [(1 << 16) * i for i in range(4)] * 2
    for n, calls in ((40, [32, 8]), (3, [3])):
        kernel = RowKernel()
        q = torch.empty(n, 8, 1 << 14, 64, device="meta")
        BatchLimitedKernel(kernel, FUSED_GRID_LIMIT).forward(q, q, q, BlockOptions(0.1))
        assert [problems for problems, _ in kernel.forwards] == calls
        assert {rows for rows, _, _ in kernel.rows} == {1 << 14}
