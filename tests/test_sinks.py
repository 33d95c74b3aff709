"""Attention sinks (docs/spec.md, section 5): a per-head logit joining every query's softmax
denominator once, as a feature of the call, exact against the float64 oracle forward and
backward (``q``, ``k``, ``v`` and the sinks, through ``out`` and ``lse``), for every kernel,
under ``torch.compile``, in the modules and in decoding; validated before any work."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ringdilated
from ringdilated.core.run import merge_sinks, sinks_gradient
from ringdilated.testing import assert_within_tolerance, dense_attention, max_error, oracle
from tests.strategies import Case, cases, loss_of, upstream

KERNELS = ["sdpa", "reference"]


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float64 else dtype


@st.composite
def cases_with_sinks(draw: st.DrawFn) -> tuple[Case, list[float]]:
    """A case and one sink logit per query head, from far below its rows' lse to far above."""
    case = draw(cases())
    return case, [draw(st.floats(-6.0, 8.0)) for _ in range(case.num_heads)]


def _sinks(logits: list[float], requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor(logits, dtype=torch.float32).requires_grad_(requires_grad)


@pytest.mark.parametrize("kernel", KERNELS)
@given(drawn=cases_with_sinks())
def test_forward_and_lse_match_the_oracle(kernel: str, drawn: tuple[Case, list[float]]) -> None:
    case, logits = drawn
    q, k, v = case.tensors()
    sinks = _sinks(logits)
    pattern = (case.segment_lengths, case.dilation_rates)
    kw = {**case.kwargs(), "sinks": sinks}
    out, lse = ringdilated.dilated_attention(
        q, k, v, *pattern, **kw, kernel=kernel, return_lse=True
    )
    assert out.dtype == case.dtype and lse.dtype == torch.float32
    expected_out, expected_lse = oracle(q, k, v, *pattern, **kw, return_lse=True)
    base_out, _ = dense_attention(q, k, v, *pattern, **kw)
    _, base_lse = dense_attention(q, k, v, *pattern, **kw, dtype=_lse_dtype(case.dtype))
    assert_within_tolerance(out, expected_out, base_out, what="out")
    assert_within_tolerance(lse, expected_lse, base_lse, dtype=_lse_dtype(case.dtype), what="lse")


@pytest.mark.parametrize("kernel", KERNELS)
@given(drawn=cases_with_sinks())
def test_gradients_match_the_oracle(kernel: str, drawn: tuple[Case, list[float]]) -> None:
    """Through ``out`` and ``lse``, for ``q``, ``k``, ``v`` and the sinks."""
    case, logits = drawn
    q, k, v = case.tensors(requires_grad=True)
    sinks = _sinks(logits, requires_grad=True)
    pattern = (case.segment_lengths, case.dilation_rates)
    kw = {**case.kwargs(), "sinks": sinks}
    out, lse = ringdilated.dilated_attention(
        q, k, v, *pattern, **kw, kernel=kernel, return_lse=True
    )
    dout, dlse = upstream(case.seed, out, lse)
    inputs = (q, k, v, sinks)
    grads = torch.autograd.grad(loss_of(out, lse, dout, dlse), inputs)
    expected = torch.autograd.grad(
        loss_of(*oracle(q, k, v, *pattern, **kw, return_lse=True), dout, dlse), inputs
    )
    baseline = torch.autograd.grad(
        loss_of(*dense_attention(q, k, v, *pattern, **kw), dout, dlse), inputs
    )
    for name, actual, exp, base in zip("qkvs", grads, expected, baseline, strict=True):
        assert actual.dtype == (torch.float32 if name == "s" else case.dtype)
        # The sinks' gradient is float32, but it is read from the call's out, rounded to the
        # inputs' dtype (rowsum(dout * out)): judged in that dtype, as every other gradient.
        assert_within_tolerance(actual, exp, base, dtype=case.dtype, what=f"d{name}")


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_rows_that_see_no_key_give_zero_and_the_sink(mode: str) -> None:
    """Unselected positions (head_groups) and the empty rows of a window: ``out = 0``,
    ``lse = s_h``; padded positions are no query: ``out = 0``, ``lse = -inf`` (no sink); in
    longnet mode the sink joins the union once."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 16, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.5, -1.0, 2.0, 3.0])
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[1, 12:] = True
    out, lse = ringdilated.dilated_attention(
        q, k, v, [4, 8], [2, 4], mode=mode, sinks=sinks, key_padding_mask=mask, return_lse=True
    )
    expected_out, expected_lse = oracle(
        q, k, v, [4, 8], [2, 4], mode=mode, sinks=sinks, key_padding_mask=mask, return_lse=True
    )
    assert max_error(out, expected_out) < 1e-12
    assert max_error(lse, expected_lse.float()) < 1e-6
    assert bool(lse[1, :, 12:].isneginf().all())
    if mode == "head_groups":  # head 0 (rate 2, offset 0) does not select odd positions
        assert torch.equal(lse[0, 0, 1::2], torch.full((8,), 0.5))
    assert bool((out[1, 12:] == 0).all())
    if mode == "longnet":  # once over the union: a query under two patterns has one sink
        _, plain_lse = oracle(
            q, k, v, [4, 8], [2, 4], mode=mode, key_padding_mask=mask, return_lse=True
        )
        seen = torch.isfinite(plain_lse)
        merged = torch.logaddexp(plain_lse, sinks.double().view(1, -1, 1))
        assert max_error(lse[seen], merged[seen].float()) < 1e-6


def test_a_sink_of_minus_infinity_is_no_sink() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([float("-inf"), float("-inf")], requires_grad=True)
    out, lse = ringdilated.dilated_attention(
        q, k, v, [8], [2], sinks=sinks, return_lse=True, kernel="reference"
    )
    plain, plain_lse = ringdilated.dilated_attention(
        q, k, v, [8], [2], return_lse=True, kernel="reference"
    )
    assert torch.equal(out, plain) and torch.equal(lse, plain_lse)
    (grad,) = torch.autograd.grad(out.sum() + lse.masked_fill(lse.isneginf(), 0).sum(), sinks)
    assert torch.equal(grad, torch.zeros(2))  # no NaN from rows that see nothing at all


def test_merge_and_gradient_against_autograd_of_the_definition() -> None:
    """The merge's gradient for the sinks, written from the module docstring, against autograd
    through ``log(exp(lse) + exp(s))`` in float64, with rows that see no key."""
    g = torch.Generator().manual_seed(2)
    out = torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64)
    lse = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    lse[0, 1, 2] = float("-inf")
    out[0, 2, 1] = 0.0
    sinks = torch.randn(3, generator=g, dtype=torch.float64)
    merged_out, merged_lse = merge_sinks(out, lse, sinks)
    total = torch.log(torch.exp(lse) + torch.exp(sinks).view(1, -1, 1))
    assert max_error(merged_lse, total) < 1e-14
    assert max_error(merged_out, out * torch.exp(lse - total).transpose(1, 2).unsqueeze(-1)) < 1e-14
    leaf = sinks.clone().requires_grad_()
    total = torch.log(torch.exp(lse) + torch.exp(leaf).view(1, -1, 1))
    again = out * torch.exp(lse - total).transpose(1, 2).unsqueeze(-1)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    (expected,) = torch.autograd.grad((again * dout).sum() + (total * dlse).sum(), leaf)
    assert max_error(sinks_gradient(dout, dlse, merged_out, merged_lse, sinks), expected) < 1e-13


@pytest.mark.parametrize("documents", [None, [0, 5, 16]])
def test_torch_compile_traces_sinks_and_softcap(documents: list[int] | None) -> None:
    """``fullgraph=True`` (no graph break): the op ``ringdilated::attention``, or with documents
    ``ringdilated::dilated_attention``, takes the sinks as a tensor input and returns their
    gradient from its backward op."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 16, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    extra = {} if documents is None else {"cu_seqlens": torch.tensor(documents)}
    lse_asked = documents is None  # the documents' op returns no lse to the caller

    def call(q, k, v, s):  # type: ignore[no-untyped-def]
        return ringdilated.dilated_attention(
            q, k, v, [8, 16], [1, 2], mode="longnet", causal=True, sinks=s, softcap=3.0,
            kernel="reference", return_lse=lse_asked, **extra,
        )  # fmt: skip

    result = torch.compile(call, fullgraph=True, backend="aot_eager")(*leaves)
    out, lse = result if lse_asked else (result, None)
    exact = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
    expected, expected_lse = oracle(
        *exact[:3], [8, 16], [1, 2], mode="longnet", causal=True, sinks=exact[3], softcap=3.0,
        return_lse=True, **extra,
    )  # fmt: skip
    assert max_error(out, expected) < 1e-12
    loss, exact_loss = out.sum(), expected.sum()
    if lse is not None:
        assert max_error(lse, expected_lse.float()) < 1e-6
        loss, exact_loss = loss + lse.sum(), exact_loss + expected_lse.float().sum()
    grads = torch.autograd.grad(loss, leaves)
    exact_grads = torch.autograd.grad(exact_loss, exact)
    for actual, wanted in zip(grads, exact_grads, strict=True):
        assert max_error(actual, wanted) < 1e-5  # the lse's float32 rounding


def test_a_query_suffix_and_documents_with_sinks() -> None:
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 24, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([1.0, 0.0, -2.0, 4.0], dtype=torch.float64)
    for mode in ("head_groups", "longnet"):
        for extra in ({"cu_seqlens": torch.tensor([0, 9, 24])}, {}):
            got = ringdilated.dilated_attention(
                q[:, 17:], k, v, [8, 12], [1, 2], mode=mode, causal=True, sinks=sinks, **extra
            )
            want = oracle(
                q[:, 17:], k, v, [8, 12], [1, 2], mode=mode, causal=True, sinks=sinks, **extra
            )
            assert max_error(got, want) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_sinks_widen_exactly(dtype: torch.dtype) -> None:
    """A module converted to half precision holds its sinks so: they are widened, not
    rounded, so the call equals the one with the same logits in float32."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g).to(dtype) for _ in range(3))
    half = torch.tensor([0.3, -1.7]).to(dtype)
    got = ringdilated.dilated_attention(q, k, v, [16], [1], sinks=half)
    same = ringdilated.dilated_attention(q, k, v, [16], [1], sinks=half.float())
    assert torch.equal(got, same)


@pytest.mark.parametrize(
    ("sinks", "error", "message"),
    [
        (torch.zeros(1), ValueError, "sinks must have shape (4,), one logit per query head of q "
                                     "(1, 8, 4, 8) (never broadcast), got shape (1,)"),
        (torch.zeros(4, 1), ValueError, "got shape (4, 1)"),
        (torch.zeros(2), ValueError, "got shape (2,)"),  # the key/value heads' count
        (torch.zeros(4, dtype=torch.int64), TypeError, "got torch.int64"),
        (torch.zeros(4, dtype=torch.float64), TypeError,
         "sinks is float64, but a torch.float32 call merges sinks in float32"),
        ([0.0] * 4, TypeError, "sinks must be a torch.Tensor of shape (H,) or None, got [0.0,"),
        (torch.zeros(4, device="meta"), ValueError, "sinks must be on q's device cpu, got meta"),
    ],
)  # fmt: skip
def test_bad_sinks_are_refused_before_any_work(sinks: object, error: type, message: str) -> None:
    q = torch.randn(1, 8, 4, 8)
    kv = torch.randn(1, 8, 2, 8)
    with pytest.raises(error, match=re.escape(message)):
        ringdilated.dilated_attention(q, kv, kv, [8], [1], sinks=sinks)  # type: ignore[arg-type]
    cache = ringdilated.DilatedKVCache([8], [1], num_heads=4, num_kv_heads=2)
    with pytest.raises(error, match=re.escape(message)):
        cache.attend(q, kv, kv, sinks=sinks)  # type: ignore[arg-type]


def test_float64_sinks_serve_float64_calls() -> None:
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.1234567890123, -0.5], dtype=torch.float64)
    got = ringdilated.dilated_attention(q, k, v, [8], [1], sinks=sinks)
    assert max_error(got, oracle(q, k, v, [8], [1], sinks=sinks)) < 1e-14


def test_sinks_are_in_the_plan_key_by_shape_and_dtype_not_values() -> None:
    """New values every call reuse the plan; a call with other sinks metadata is planned (and
    checked) anew."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    layout = ringdilated.SequenceLayout(agree_every_call=False)
    for logits in ([0.0, 1.0], [3.0, -2.0], None):
        sinks = None if logits is None else torch.tensor(logits)
        got = ringdilated.dilated_attention(q, k, v, [8], [1], sinks=sinks, layout=layout)
        assert max_error(got, oracle(q, k, v, [8], [1], sinks=sinks)) < 1e-12
    assert len(layout.plans) == 2
    with pytest.raises(ValueError, match="got shape"):
        ringdilated.dilated_attention(q, k, v, [8], [1], sinks=torch.zeros(3), layout=layout)


def test_modules_own_learnable_sinks() -> None:
    torch.manual_seed(0)
    block = ringdilated.DilatedTransformerBlock(
        16, 4, segment_lengths=[4, 8], dilation_rates=[1, 2], mode="longnet", causal=True,
        sinks=True, dtype=torch.float64,
    )  # fmt: skip
    attn = block.attn
    assert isinstance(attn.sinks, torch.nn.Parameter) and attn.sinks.shape == (4,)
    assert torch.equal(attn.sinks, torch.zeros(4, dtype=torch.float64))
    assert "attn.sinks" in dict(block.named_parameters())
    with torch.no_grad():
        attn.sinks.copy_(torch.tensor([1.0, -1.0, 0.5, 2.0]))
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    out = attn(x, x, x)[0]
    (grad,) = torch.autograd.grad(out.sum(), attn.sinks)
    q = attn.q_proj(x).view(2, 12, 4, 4)
    k, v = attn.k_proj(x).view(2, 12, 4, 4), attn.v_proj(x).view(2, 12, 4, 4)
    sinks = attn.sinks.detach().clone().requires_grad_()
    expected = oracle(q, k, v, [4, 8], [1, 2], mode="longnet", causal=True, sinks=sinks)
    final = attn.out_proj(attn.norm(expected.reshape(2, 12, 16)))
    assert max_error(out, final) < 1e-10
    (expected_grad,) = torch.autograd.grad(final.sum(), sinks)
    assert max_error(grad, expected_grad) < 1e-10
    plain = ringdilated.MultiheadDilatedAttention(16, 4, segment_lengths=[4], dilation_rates=[1])
    assert plain.sinks is None and "sinks" not in dict(plain.named_parameters())
    with pytest.raises(TypeError, match="sinks must be a bool, got 1"):
        ringdilated.MultiheadDilatedAttention(
            16,
            4,
            segment_lengths=[4],
            dilation_rates=[1],
            sinks=1,  # type: ignore[arg-type]
        )


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_decoding_with_sinks_equals_the_whole_call(mode: str) -> None:
    """Prefill, one-token steps and a chunk of several tokens: every step's rows are the full
    call's, with the sinks, and differentiable in them."""
    torch.manual_seed(1)
    attn = ringdilated.MultiheadDilatedAttention(
        16, 4, segment_lengths=[4, 8], dilation_rates=[1, 2], mode=mode, causal=True,
        sinks=True, softcap=2.0, kernel="reference", dtype=torch.float64,
    )  # fmt: skip
    with torch.no_grad():
        attn.sinks.copy_(torch.tensor([0.5, -1.0, 1.5, 0.0]))
    x = torch.randn(2, 14, 16, dtype=torch.float64)
    whole = attn(x, x, x)[0]
    cache = attn.make_cache()
    steps = [attn(x[:, :5], x[:, :5], x[:, :5], cache=cache)[0]]
    for t in range(5, 9):
        steps.append(attn(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], cache=cache)[0])
    steps.append(attn(x[:, 9:], x[:, 9:], x[:, 9:], cache=cache)[0])
    decoded = torch.cat(steps, 1)
    assert max_error(decoded, whole) < 1e-10
    (grad,) = torch.autograd.grad(steps[3].sum(), attn.sinks)  # a one-token step
    (expected,) = torch.autograd.grad(whole[:, 7].sum(), attn.sinks)
    assert max_error(grad, expected) < 1e-10


def test_cache_steps_return_the_lse_with_the_sink() -> None:
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 10, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.tensor([0.7, -0.3], dtype=torch.float64)
    cache = ringdilated.DilatedKVCache([4, 8], [1, 2], num_heads=2, causal=True)
    parts = [cache.attend(q[:, :6], k[:, :6], v[:, :6], True, sinks=sinks)]
    parts += [cache.attend(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], True, sinks=sinks)
              for t in range(6, 8)]  # fmt: skip
    parts.append(cache.attend(q[:, 8:], k[:, 8:], v[:, 8:], True, sinks=sinks))
    out = torch.cat([o for o, _ in parts], 1)
    lse = torch.cat([s for _, s in parts], 2)
    want, want_lse = oracle(q, k, v, [4, 8], [1, 2], causal=True, sinks=sinks, return_lse=True)
    assert max_error(out, want) < 1e-12
    assert lse.dtype == torch.float32 and max_error(lse, want_lse.float()) < 1e-6


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_dropout_with_sinks_is_the_merge_of_the_same_call_without_them(mode: str) -> None:
    """The same seed draws the same masks with and without sinks, so the call with sinks must
    equal the call without them merged with the sinks by plain autograd (which sends the merge's
    gradient through the call's lse path): forward and every gradient. This holds the shortcut
    (the kernels' backward handed the merged out and lse) to the composition, under dropout."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 16, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    sinks = torch.randn(4, generator=g, dtype=torch.float64)
    dout = torch.randn(2, 16, 4, 8, generator=g, dtype=torch.float64)
    kw = {"mode": mode, "causal": True, "dropout_p": 0.3, "kernel": "reference"}
    results = []
    for with_sinks in (True, False):
        leaves = [x.clone().requires_grad_() for x in (q, k, v, sinks)]
        torch.manual_seed(0)
        if with_sinks:
            out = ringdilated.dilated_attention(*leaves[:3], [8, 16], [1, 2], sinks=leaves[3], **kw)
        else:
            plain, lse = ringdilated.dilated_attention(
                *leaves[:3], [8, 16], [1, 2], return_lse=True, **kw
            )
            out, _ = merge_sinks(plain, lse.double(), leaves[3])
        results.append((out, torch.autograd.grad((out * dout).sum(), leaves)))
    (fused, fused_grads), (composed, composed_grads) = results
    # Another mask would differ by O(1); the composed path merges with the public float32 lse.
    assert max_error(fused, composed) < 1e-6
    for a, b in zip(fused_grads, composed_grads, strict=True):
        assert max_error(a, b) < 1e-6


def test_a_second_derivative_through_the_sinks_says_it_is_not_supported() -> None:
    g = torch.Generator().manual_seed(10)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=g).requires_grad_() for _ in range(3))
    sinks = torch.zeros(2, requires_grad=True)
    out = ringdilated.dilated_attention(q, k, v, [8], [1], sinks=sinks)
    (dsinks,) = torch.autograd.grad(out.sum(), sinks, create_graph=True)
    with pytest.raises(RuntimeError, match="ringdilated does not support higher-order gradients"):
        dsinks.sum().backward()
