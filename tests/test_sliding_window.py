"""The key window ``(left, right)`` of docs/spec.md, section 5, end to end (issue 24): every call
against the float64 oracle (``window=``), forward and gradients, with documents, padding, a query
suffix, grouped heads, both modes, dropout and decoding; its checks; and what it saves: a dense
pattern with a window (a sliding-window layer) computes about ``L x window`` scores, and a
sharded call sends only the keys a receiver's queries see (the gloo runs are in
tests/test_distributed.py, whose cases draw windows too)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ringdilated
from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
from ringdilated.backends.sdpa import SDPA_SPEC, SdpaKernel
from ringdilated.core import (
    FULL,
    BatchLimit,
    BlockOptions,
    Capabilities,
    DilationPattern,
    KernelSpec,
    KeyWindow,
    Request,
    ResolutionError,
    Resolver,
    Target,
)
from ringdilated.core.plan.shards import payload, shard_plan
from ringdilated.core.run.limited import WINDOW_CHUNK_ROWS
from ringdilated.functional import attend
from ringdilated.testing import assert_within_tolerance, dense_attention, oracle
from tests.distributed_harness import Workers
from tests.strategies import Case, LayoutCase, cases, layouts, loss_of, upstream

pytestmark = pytest.mark.filterwarnings("ignore:key_padding_mask .* is True at every position")

KERNELS = ["sdpa", "reference"]


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float64 else dtype


# -- the property: any window, pattern, documents, padding, suffix --------------------------------


@pytest.mark.parametrize("kernel", KERNELS)
@given(case=cases(dtypes=(torch.float64, torch.float32), max_len=28, windows=True), data=st.data())
def test_windows_match_the_oracle(kernel: str, case: Case, data: st.DataObject) -> None:
    """``out``, ``lse`` and the gradients of a loss through both, against the float64 oracle
    with the tolerance rule (docs/spec.md, section 4) for float64 and float32, for a random
    window (each bound ``None`` or from 0 past the sequence) over a random pattern, mode,
    grouped heads, packed documents or padded rows, and a query suffix half the time."""
    layout: LayoutCase = data.draw(layouts(case.batch, case.seq_len))
    q, k, v = case.tensors(requires_grad=True)
    pattern = (case.segment_lengths, case.dilation_rates)
    kw: dict[str, Any] = {**case.kwargs(), **layout.kwargs()}
    queries = layout.queries(q)
    out, lse = ringdilated.dilated_attention(
        queries, k, v, *pattern, **kw, kernel=kernel, return_lse=True
    )
    exact = dense_attention(queries, k, v, *pattern, **kw, dtype=torch.float64)
    base_out, _ = dense_attention(queries, k, v, *pattern, **kw)
    _, base_lse = dense_attention(queries, k, v, *pattern, **kw, dtype=_lse_dtype(case.dtype))
    assert_within_tolerance(out, exact[0], base_out, what="out")
    assert_within_tolerance(lse, exact[1], base_lse, dtype=_lse_dtype(case.dtype), what="lse")
    dout, dlse = upstream(case.seed, out, lse)
    grads = torch.autograd.grad(loss_of(out, lse, dout, dlse), (q, k, v))
    expected = torch.autograd.grad(loss_of(*exact, dout, dlse), (q, k, v))
    baseline = torch.autograd.grad(
        loss_of(*dense_attention(queries, k, v, *pattern, **kw), dout, dlse), (q, k, v)
    )
    for name, actual, exp, base in zip("qkv", grads, expected, baseline, strict=True):
        assert_within_tolerance(actual, exp, base, what=f"d{name}")


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_a_window_counts_positions_not_selected_keys(mode: str) -> None:
    """Worked by hand: rate 3, one segment of 12, offset 0 (head 0 in ``head_groups``): query 9
    selects keys 0, 3, 6, 9; a window of left 5 keeps 6 and 9 (positions 4 to 9), two selected
    keys, not five; and the result is exactly attention over those two."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 12, 1, 4, generator=g, dtype=torch.float64) for _ in range(3))
    out = ringdilated.dilated_attention(q, k, v, [12], [3], mode=mode, window=(5, 0))
    scores = (q[0, 9, 0] @ k[0, [6, 9], 0].T) / 2.0
    expected = torch.softmax(scores, -1) @ v[0, [6, 9], 0]
    assert torch.allclose(out[0, 9, 0], expected, atol=1e-14, rtol=0)
    assert torch.allclose(out, oracle(q, k, v, [12], [3], mode=mode, window=(5, 0)), atol=1e-14)


@pytest.mark.filterwarnings("ignore::ringdilated.SlowFeatureWarning")  # reference: dropout on CPU
@pytest.mark.parametrize("segments", [[256], [96, 256]])
def test_dropout_under_a_window_replays_its_masks_in_backward(segments: list[int]) -> None:
    """With dropout, ``out`` is linear in ``v`` under one seed's masks, so a difference in ``v``
    with the seed replayed is exactly ``<dv, dout>`` (the backward draws every band's mask as
    its forward did, a sliding window's blocks cut into bands of rows); and a value outside
    every query's window changes nothing."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1200, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    v.requires_grad_()
    rates = [1] * len(segments)
    kw: dict[str, Any] = {"window": (20, 0), "dropout_p": 0.3, "kernel": "reference"}

    def run(values: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(11)
        return ringdilated.dilated_attention(q, k, values, segments, rates, **kw)

    out = run(v)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (dv,) = torch.autograd.grad(out, v, dout)
    step = torch.randn(v.shape, generator=g, dtype=torch.float64)
    moved = run(v.detach() + step)
    assert torch.allclose(((moved - out) * dout).sum(), (dv * step).sum(), atol=1e-9, rtol=0)
    far = v.detach().clone()
    far[:, 0] += 100.0  # position 0: seen by queries 0 to 20 only
    assert torch.equal(run(far)[:, 21:], out[:, 21:].detach())


# -- checked before any work, errors quoting the value ---------------------------------------------


class Refuses(ReferenceKernel):
    """A kernel no valid call reaches: every call raises."""

    def forward(self, *args: Any) -> Any:
        raise AssertionError("a kernel ran for an invalid call")


@pytest.mark.parametrize(
    ("window", "causal", "error", "message"),
    [
        ("x", False, TypeError, "got window='x'"),
        ((1, 2, 3), False, TypeError, r"got window=\(1, 2, 3\)"),
        ((1.5, 0), False, TypeError, r"got window=\(1\.5, 0\)"),
        ((True, 0), False, TypeError, r"got window=\(True, 0\)"),
        ((-1, 0), False, ValueError, r"got window=\(-1, 0\) \(a negative bound is refused"),
        ((0, -2), False, ValueError, r"window=\(0, -2\)"),
        ((4, 2), True, ValueError, r"causal=True asks for right = 0, but window=\(4, 2\)"),
    ],
)
def test_bad_windows_raise_before_any_work(
    window: object, causal: bool, error: type, message: str
) -> None:
    resolver = Resolver([attrs.evolve(REFERENCE_SPEC, name="refuses", factory=Refuses)])
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(error, match=message):
        attend(
            ([8], [1]), q, q, q, causal=causal, window=window, scale=None, dropout_p=0.0,
            kernel="refuses", resolver=resolver,
        )  # fmt: skip
    window_arg: Any = window
    with pytest.raises(error, match=message):
        ringdilated.DilatedAttention([8], [1], causal=causal, window=window_arg)


def test_a_window_with_causal_and_without_a_right_bound_is_causal() -> None:
    """``causal=True`` is ``right = 0``: ``(4, None)`` with it equals ``(4, 0)``, and the module
    keeps ``(4, 0)``; numpy ints and lists are windows too."""
    import numpy

    q = torch.randn(1, 16, 2, 4, dtype=torch.float64)
    a = ringdilated.dilated_attention(q, q, q, [16], [1], causal=True, window=(4, None))
    b = ringdilated.dilated_attention(q, q, q, [16], [1], window=[numpy.int64(4), 0])
    assert torch.equal(a, b)
    module = ringdilated.DilatedAttention([16], [1], causal=True, window=(4, None))
    assert module.window == (4, 0) and module.key_window == KeyWindow(4, 0)
    assert "window=(4, 0)" in repr(module)


def test_the_resolver_serves_a_window_only_with_a_kernel_that_declares_it() -> None:
    """A left bound asks for ``sliding_window``: ``auto`` passes over a kernel without it (with
    the reason), and a kernel forced without it raises :class:`ResolutionError` naming it."""
    without = KernelSpec(
        name="plain",
        factory=ReferenceKernel,
        capabilities=Capabilities(targets=(Target("cpu", frozenset({torch.float64})),)),
        priority=1000,
    )
    resolver = Resolver([without, REFERENCE_SPEC, SDPA_SPEC])
    request = Request(dtype=torch.float64, head_dim=4, window=KeyWindow(4, 0))
    choice = resolver.resolve(request)
    assert choice.kernel_name == "sdpa"
    assert "does not support a sliding window" in choice.explain()
    assert resolver.resolve(Request(dtype=torch.float64, head_dim=4)).kernel_name == "plain"
    q = torch.randn(1, 8, 2, 4, dtype=torch.float64)
    with pytest.raises(ResolutionError, match="sliding window"):
        attend(
            ([8], [1]), q, q, q, causal=False, window=(2, 0), scale=None, dropout_p=0.0,
            kernel="plain", resolver=resolver,
        )  # fmt: skip


# -- a sliding-window layer costs about L x window -----------------------------------------------


class Counting:
    """``kernel``, counting the scores (query rows x keys x problems x heads) of its calls."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.scores, self.calls = kernel, 0, 0

    def forward(self, q, k, v, options):  # type: ignore[no-untyped-def]
        self.scores += q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        self.calls += 1
        return self.kernel.forward(q, k, v, options)

    def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
        return self.kernel.backward(dout, q, k, v, out, lse, options)


@pytest.mark.parametrize("make", [ReferenceKernel, SdpaKernel], ids=["reference", "sdpa"])
def test_a_sliding_window_layer_computes_about_length_times_window_scores(make: type) -> None:
    """One segment over the sequence at rate 1 with ``window=(32, 0)`` (a causal sliding-window
    layer) at L = 2048: the kernel computes at most ``L x (256 + 33)`` scores per head (bands of
    :data:`WINDOW_CHUNK_ROWS` rows, each with the keys its rows see), under a seventh of the
    ``L x L`` a whole block would, and the oracle's results."""
    length, window = 2048, 32
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, length, 1, 8, generator=g, dtype=torch.float64) for _ in range(3))
    kernel = Counting(make())
    spy: Any = kernel
    out = ringdilated.dilated_attention(q, k, v, [length], [1], window=(window, 0), kernel=spy)
    assert kernel.scores <= length * (WINDOW_CHUNK_ROWS + window + 1)
    assert kernel.scores < length * length / 7
    expected = oracle(q, k, v, [length], [1], window=(window, 0))
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)


def test_a_kernel_that_skips_hidden_keys_gets_a_windows_block_whole() -> None:
    """A kernel declaring ``BatchLimit(skips_hidden_keys=True)`` (its work follows the keys a
    window shows: flex's block mask) gets the sliding-window layer's block in one call, all
    ``L x L`` of it handed over."""
    length = 2048
    kernel = Counting(ReferenceKernel())
    limit = BatchLimit(query_elements=None, skips_hidden_keys=True)
    spec = attrs.evolve(
        REFERENCE_SPEC,
        name="skipping",
        factory=lambda: kernel,
        capabilities=attrs.evolve(REFERENCE_SPEC.capabilities, batch_limit=limit),
    )
    q = torch.randn(1, length, 1, 8, dtype=torch.float64)
    attend(
        ([length], [1]), q, q, q, causal=False, window=(32, 0), scale=None, dropout_p=0.0,
        kernel="skipping", resolver=Resolver([spec]),
    )  # fmt: skip
    assert (kernel.calls, kernel.scores) == (1, length * length)


def _windowed_gpu_specs() -> list[Any]:
    from ringdilated.backends.flash import FLASH_SPEC
    from ringdilated.backends.flash3 import FLASH3_SPEC
    from ringdilated.backends.flash4 import FLASH4_SPEC
    from ringdilated.backends.torch_flash import TORCH_FLASH_SPEC

    return [FLASH_SPEC, FLASH3_SPEC, FLASH4_SPEC, TORCH_FLASH_SPEC]


@pytest.mark.parametrize("spec", _windowed_gpu_specs(), ids=lambda spec: spec.name)
def test_flash_kernels_get_a_sliding_windows_block_whole(spec: Any) -> None:
    """flash-attn 2/3/4 and torch's flash op skip the key tiles a ``window_size`` hides, so
    their specs say so (``skips_hidden_keys``) and the driver hands a sliding-window layer's
    block to them in one call (their window pieces then make at most three), not in bands of
    :data:`WINDOW_CHUNK_ROWS` rows: eight launches at L = 2048 for every one. Checked with the
    real spec's capabilities on a CPU target, a counting reference kernel in its place, and the
    oracle's result."""
    from tests.test_gpu_kernel_wrappers import on_cpu

    assert spec.capabilities.batch_limit.skips_hidden_keys
    length = 2048
    kernel = Counting(ReferenceKernel())
    counted = attrs.evolve(
        on_cpu(spec, frozenset({torch.float64})), name="counted", factory=lambda: kernel
    )
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, length, 1, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out, _, _ = attend(
        ([length], [1]), q, k, v, causal=True, window=(32, 0), scale=None, dropout_p=0.0,
        kernel="counted", resolver=Resolver([counted]),
    )  # fmt: skip
    assert kernel.calls == 1
    expected = oracle(q, k, v, [length], [1], causal=True, window=(32, 0))
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("window", [KeyWindow(40, -300), KeyWindow(3, 9), KeyWindow(-500, None)])
def test_a_crossing_piece_under_a_window_computes_only_its_bands(window: KeyWindow) -> None:
    """:class:`BatchLimitedKernel` (a sharded run's crossing pieces) under windows as another
    rank's piece gets them (a band below the diagonal, a narrow band, rows at the start seeing
    nothing): the kit's dense float64 reference, forward and backward, and only the scores of
    the bands (at most ``rows x (256 + width)``), nothing for rows that see no key."""
    from ringdilated.core.run.limited import BatchLimitedKernel
    from ringdilated.testing.kernel_cases import dense

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 1500, 4, generator=g, dtype=torch.float64) for _ in range(3))
    counting = Counting(ReferenceKernel())
    kernel = BatchLimitedKernel(counting, BatchLimit(query_elements=None))  # type: ignore[arg-type]
    options = BlockOptions(0.5, window)
    out, lse = kernel.forward(q, k, v, options)
    expected, expected_lse = dense(q, k, v, 0.5, window)
    assert torch.allclose(out, expected, atol=1e-12, rtol=0)
    assert torch.equal(lse.isneginf(), expected_lse.isneginf())
    assert torch.allclose(lse[lse.isfinite()], expected_lse[lse.isfinite()], atol=1e-12)
    if window.right is not None:
        width = window.left + window.right + 1  # type: ignore[operator]
        assert counting.scores <= 2 * 2 * 1500 * (WINDOW_CHUNK_ROWS + max(width, 0))
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = kernel.backward(dout, q, k, v, out, lse, options)
    exact = [x.clone().requires_grad_() for x in (q, k, v)]
    reference = torch.autograd.grad((dense(*exact, 0.5, window)[0] * dout).sum(), exact)
    for got, want in zip(grads, reference, strict=True):
        assert torch.allclose(got, want, atol=1e-11, rtol=0)


# -- the plan: what moves between ranks ------------------------------------------------------------


def test_a_sliding_window_sends_only_the_last_left_positions_to_the_next_rank() -> None:
    """Worked by hand: one segment of 32 at rate 1 on 4 ranks of 8, ``window=(3, 0)``: rank
    ``r`` sends rank ``r + 1`` its last three keys (local positions 5, 6, 7) and nothing to
    ``r + 2`` or any earlier rank; a window of 11 reaches two ranks on (local 5, 6, 7 to
    ``r + 2``); a right bound of 2 sends rank ``r - 1`` its first two."""
    plans = [shard_plan(DilationPattern([32], [1]), 32, 1, 1, r, 4) for r in range(4)]
    for r in range(4):
        for dst in range(4):
            if dst == r:
                continue
            sent = payload(plans[r], r, dst, KeyWindow(3, 0)).positions
            assert sent == (((5, 6, 7),) if dst == r + 1 else ()), (r, dst, sent)
    wide = payload(plans[0], 0, 2, KeyWindow(11, 0)).positions
    assert wide == ((5, 6, 7),)
    assert payload(plans[2], 2, 1, KeyWindow(3, 2)).positions == ((0, 1),)
    assert plans[1].elements_sent(head_dim=4, batch=2, window=KeyWindow(3, 0)) == 2 * 2 * 4 * 3


def test_the_keys_sent_are_exactly_those_some_query_of_the_receiver_sees() -> None:
    """Every crossing of a dilated pattern on uneven shards under several windows: the keys
    :meth:`Crossing.sent` names are, position by position, those some query of the receiver's
    piece sees (from the positions and the window's definition, in positions)."""
    pattern = DilationPattern([12, 20], [2, 3])
    lengths = (7, 9, 4, 12)
    starts = (0, 7, 16, 20, 32)
    for window in (FULL, KeyWindow(None, 0), KeyWindow(4, 0), KeyWindow(9, 3), KeyWindow(0, 5)):
        for rank in range(4):
            plan = shard_plan(pattern, 32, 2, 2, rank, 4, None, lengths)
            for c in plan.crossings:
                for src in c.pieces:
                    for dst in c.pieces:
                        if src.rank == dst.rank:
                            continue
                        keys = [src.first + j * src.selection.rate for j in range(src.count)]
                        queries = [dst.first + i * dst.selection.rate for i in range(dst.count)]
                        left = 10**9 if window.left is None else window.left
                        right = 10**9 if window.right is None else window.right
                        seen = [
                            j for j, key in enumerate(keys)
                            if any(p - left <= key <= p + right for p in queries)
                        ]  # fmt: skip
                        first, stop = c.sent(src.rank, dst.rank, window)
                        assert list(range(first, stop)) == seen, (window, c, src, dst)
                        assert c.sends(src.rank, dst.rank, window) == bool(seen)
                        assert starts[src.rank] == src.origin


# -- the faces: modules, decoding ----------------------------------------------------------------


def test_the_modules_pass_their_window_on() -> None:
    """A MultiheadDilatedAttention (and a block) with a window equals its projections through
    the functional call with that window; the cache it makes carries the window, and a cache
    of another window is refused, naming it."""
    torch.manual_seed(0)
    kw: dict[str, Any] = {"segment_lengths": [8, 16], "dilation_rates": [1, 2], "causal": True}
    mha = ringdilated.MultiheadDilatedAttention(
        16, 4, window=(3, None), dtype=torch.float64, layer_norm=False, **kw
    )
    x = torch.randn(2, 16, 16, dtype=torch.float64)
    out, _ = mha(x, x, x)
    shape = (2, 16, 4, 4)
    q, k, v = (p(x).view(shape) for p in (mha.q_proj, mha.k_proj, mha.v_proj))
    attended = oracle(q, k, v, [8, 16], [1, 2], causal=True, window=(3, 0))
    assert torch.allclose(out, mha.out_proj(attended.reshape(2, 16, 16)), atol=1e-12, rtol=0)
    cache = mha.make_cache()
    assert cache.window == (3, 0)
    other = ringdilated.DilatedKVCache([8, 16], [1, 2], num_heads=4, window=(5, 0))
    with pytest.raises(ValueError, match=r"window: the cache's \(5, 0\), the module's \(3, 0\)"):
        mha(x, x, x, cache=other)
    block = ringdilated.DilatedTransformerBlock(16, 4, window=(3, 0), **kw)
    assert block.attn.attention.window == (3, 0)


@pytest.mark.parametrize("kernel", KERNELS)
@given(case=cases(max_len=24, windows=True), data=st.data())
def test_decoding_with_a_window_equals_the_full_recomputation(
    kernel: str, case: Case, data: st.DataObject
) -> None:
    """A :class:`~ringdilated.DilatedKVCache` with a window: a prompt, then steps of one token
    (the device-only step, its mask hiding slots more than ``left`` positions back) and of
    several (the compacted runs, the window dilated by each run's rate), each equal to the
    oracle's last rows over the sequence so far."""
    q, k, v = case.tensors()
    window = case.window if case.window is not None else (2, None)
    mode: Any = case.mode
    cache = ringdilated.DilatedKVCache(
        case.segment_lengths, case.dilation_rates, num_heads=case.num_heads,
        num_kv_heads=case.num_kv_heads, mode=mode, causal=case.causal, window=window,
        scale=case.scale, kernel=kernel,
    )  # fmt: skip
    pattern = (case.segment_lengths, case.dilation_rates)
    kw = {**case.kwargs(), "window": window}
    t = 0
    while t < case.seq_len:
        m = data.draw(st.integers(1, min(4, case.seq_len - t)), label="tokens")
        out, lse = cache.attend(q[:, t : t + m], k[:, t : t + m], v[:, t : t + m], return_lse=True)
        step = (q[:, t : t + m], k[:, : t + m], v[:, : t + m])
        expected, expected_lse = oracle(*step, *pattern, **kw, return_lse=True)
        base, _ = dense_attention(*step, *pattern, **kw)
        lse_dtype = _lse_dtype(case.dtype)
        _, base_lse = dense_attention(*step, *pattern, **kw, dtype=lse_dtype)
        assert_within_tolerance(out, expected, base, what=f"out of tokens [{t}, {t + m})")
        assert_within_tolerance(lse, expected_lse, base_lse, dtype=lse_dtype, what="lse")
        t += m


# -- every rank agrees on the window --------------------------------------------------------------


def test_ranks_with_different_windows_raise_on_every_rank(workers2: Workers) -> None:
    results = workers2.results("mismatched_window", {})
    for message in results:
        assert "window: rank 0 KeyWindow(left=3, right=0), rank 1 KeyWindow(left=4, right=0)" in (
            message
        ), message
