"""torch.compile on the single-process path: ``fullgraph=True`` (any graph break raises), the
same results as eager and the oracle, forward and backward, with and without dropout."""

from __future__ import annotations

import pytest
import torch

from ringdilated import DilatedAttention, DilatedTransformerBlock, MultiheadDilatedAttention
from ringdilated.testing import max_error, oracle


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
@pytest.mark.parametrize("kernel", ["auto", "reference"])
def test_compiled_attention_matches_the_oracle(mode: str, kernel: str) -> None:
    attn = DilatedAttention([8, 16], [1, 2], mode=mode, causal=True, kernel=kernel)
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 32, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = compiled(q, k, v, return_lse=True)
    expected, expected_lse = oracle(
        q, k, v, [8, 16], [1, 2], mode=mode, causal=True, return_lse=True
    )
    assert max_error(out, expected) < 1e-12 and max_error(lse, expected_lse) < 1e-6
    loss = lambda o, s: (o * o).sum() + s.masked_fill(s.isneginf(), 0).sum()  # noqa: E731
    grads = torch.autograd.grad(loss(out, lse), (q, k, v))
    expected_grads = torch.autograd.grad(loss(expected, expected_lse.float()), (q, k, v))
    assert max(max_error(a, b) for a, b in zip(grads, expected_grads, strict=True)) < 1e-6


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_a_compiled_sliding_window_matches_the_oracle(mode: str) -> None:
    """``window=`` reaches the custom ops (``window_left``, ``window_right``) under
    ``fullgraph=True`` (a graph break raises): without documents (the layout op) and with them
    (the one-process op), with the oracle's results and gradients."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 24, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    bounds = torch.tensor([0, 9, 24])
    for window, causal, extra in (((5, 2), False, {}), ((3, None), True, {"cu_seqlens": bounds})):
        attn = DilatedAttention([8, 24], [1, 3], mode=mode, causal=causal, window=window)
        compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
        out = compiled(q, k, v, **extra)
        expected = oracle(q, k, v, [8, 24], [1, 3], mode=mode, causal=causal, window=window,
                          **extra)  # fmt: skip
        assert max_error(out, expected) < 1e-12
        grads = torch.autograd.grad((out * out).sum(), (q, k, v))
        expected_grads = torch.autograd.grad((expected * expected).sum(), (q, k, v))
        assert max(max_error(a, b) for a, b in zip(grads, expected_grads, strict=True)) < 1e-10


def test_compiled_block_matches_eager() -> None:
    torch.manual_seed(0)
    block = DilatedTransformerBlock(
        32, 4, segment_lengths=[8, 16], dilation_rates=[1, 2], causal=True, dtype=torch.float64
    )
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 32, 32, dtype=torch.float64, requires_grad=True)
    eager = block(x)
    out = compiled(x)
    assert max_error(out, eager) < 1e-12
    grads = torch.autograd.grad(out.sum(), (x, *block.parameters()))
    eager_grads = torch.autograd.grad(eager.sum(), (x, *block.parameters()))
    assert max(max_error(a, b) for a, b in zip(grads, eager_grads, strict=True)) < 1e-10


def test_compiled_block_with_softcap_and_sinks_matches_eager() -> None:
    """The op takes the cap and the sinks (an input whose gradient its backward op returns):
    one graph, eager's results and the sinks' gradient."""
    torch.manual_seed(0)
    block = DilatedTransformerBlock(
        32, 4, segment_lengths=[8, 16], dilation_rates=[1, 2], mode="longnet", causal=True,
        softcap=5.0, sinks=True, kernel="reference", dtype=torch.float64,
    )  # fmt: skip
    with torch.no_grad():
        block.attn.sinks.copy_(torch.linspace(-1.0, 2.0, 4))
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 32, 32, dtype=torch.float64, requires_grad=True)
    eager, out = block(x), compiled(x)
    assert max_error(out, eager) < 1e-12
    grads = torch.autograd.grad(out.sum(), (x, *block.parameters()))
    eager_grads = torch.autograd.grad(eager.sum(), (x, *block.parameters()))
    assert max(max_error(a, b) for a, b in zip(grads, eager_grads, strict=True)) < 1e-10
    names = [name for name, _ in block.named_parameters()]
    assert bool(grads[1 + names.index("attn.sinks")].abs().sum() > 0)  # the sinks learn


@pytest.mark.filterwarnings("ignore::ringdilated.SlowFeatureWarning")  # reference on CPU
def test_compiled_dropout_draws_new_masks_without_recompiling() -> None:
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(16, 2, segment_lengths=[8], dilation_rates=[1], dropout=0.5)
    counts = torch._dynamo.utils.counters
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(1, 16, 16)
    first, second = compiled(x, x, x)[0], compiled(x, x, x)[0]
    assert not torch.equal(first, second)
    assert counts["stats"]["unique_graphs"] == 1
    m.eval()
    assert torch.equal(compiled(x, x, x)[0], compiled(x, x, x)[0])


def test_compiled_rejects_bad_input_with_the_eager_message() -> None:
    q, k = torch.randn(1, 8, 2, 4), torch.randn(1, 8, 2, 3)
    compiled = torch.compile(DilatedAttention([8], [1]), backend="aot_eager")
    with pytest.raises(ValueError, match="k and v head_dim must equal q's 4, got 3"):
        compiled(q, k, k)
    strict = torch.compile(DilatedAttention([8], [1]), fullgraph=True, backend="aot_eager")
    # Under fullgraph Dynamo may wrap it in its own (RuntimeError) error; the message is kept.
    with pytest.raises((ValueError, RuntimeError), match="k and v head_dim must equal q's 4"):
        strict(q, k, k)


def test_compiled_backward_runs_the_lse_pass_only_when_lse_is_used(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The op always returns the lse, so its backward gets zeros for it when only ``out`` is
    used: no extra kernel backward per block then (compiled training was 1.7x eager)."""
    import attrs

    from ringdilated.backends.reference import REFERENCE_SPEC, ReferenceKernel
    from ringdilated.registry import default_resolver

    class Counting(ReferenceKernel):
        backwards = 0

        def backward(self, dout, q, k, v, out, lse, options):  # type: ignore[no-untyped-def]
            type(self).backwards += 1
            return super().backward(dout, q, k, v, out, lse, options)

    resolver = default_resolver()
    monkeypatch.setitem(resolver.specs, "counting", attrs.evolve(REFERENCE_SPEC, name="counting"))
    monkeypatch.setitem(resolver._kernels, "counting", Counting())
    attn = DilatedAttention([8, 16], [1, 2], causal=True, kernel="counting")
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    q, k, v = (torch.randn(1, 32, 4, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    counts = []
    for module in (attn, compiled):
        Counting.backwards = 0
        module(q, k, v).sum().backward()
        counts.append(Counting.backwards)
    assert counts[0] == counts[1] > 0
    Counting.backwards = 0
    out, lse = compiled(q, k, v, return_lse=True)
    (out.sum() + lse.sum()).backward()
    assert Counting.backwards == 2 * counts[1], "with the lse used, one lse pass per block"


def test_compiled_documents_padding_and_query_suffix_match_the_oracle() -> None:
    """cu_seqlens and key_padding_mask go through the custom op (checked there), and a short q
    is the op's own shape: no graph break, the oracle's results."""
    attn = DilatedAttention([4, 8], [1, 2], causal=True)
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 20, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    bounds = torch.tensor([0, 7, 20])
    mask = torch.zeros(2, 20, dtype=torch.bool)
    mask[1, :5] = True
    for kwargs in ({"cu_seqlens": bounds}, {"key_padding_mask": mask}, {}):
        for query in (q, q[:, 13:]):
            out = compiled(query, k, v, **kwargs)
            expected = oracle(query, k, v, [4, 8], [1, 2], causal=True, **kwargs)
            assert max_error(out, expected) < 1e-12, (kwargs, query.shape)
    with pytest.raises((ValueError, RuntimeError), match="cu_seqlens must be strictly increasing"):
        compiled(q, k, v, cu_seqlens=torch.tensor([0, 7, 7, 20]))


def test_compiled_checks_what_eager_checks() -> None:
    """transfer_stats is checked on the compiled path too, and a pattern value the custom op
    cannot take (beyond int64) runs eagerly, behind a graph break, with the eager result."""
    import ringdilated

    q = torch.randn(1, 8, 2, 4)

    def call(**kwargs: object) -> torch.Tensor:
        return ringdilated.dilated_attention(q, q, q, kernel="reference", **kwargs)  # type: ignore[call-overload,no-any-return]

    compiled = torch.compile(call, backend="aot_eager")
    with pytest.raises((TypeError, RuntimeError), match="transfer_stats must be a"):
        compiled(segment_lengths=[4], dilation_rates=[1], transfer_stats=5)
    huge = compiled(segment_lengths=[2**64], dilation_rates=[1])
    eager = ringdilated.dilated_attention(q, q, q, [2**64], [1], kernel="reference")
    assert torch.equal(huge, eager)


def _no_graph_break() -> None:
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert not breaks, breaks


def test_the_functional_api_compiles_without_a_graph_break() -> None:
    import ringdilated

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return ringdilated.dilated_attention(q, k, v, [8, 16], [1, 2], causal=True)  # type: ignore[no-any-return]

    compiled = torch.compile(call, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 32, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    out = compiled(q, k, v)
    assert max_error(out, oracle(q, k, v, [8, 16], [1, 2], causal=True)) < 1e-12
    _no_graph_break()


def test_a_module_with_rotary_compiles_without_a_graph_break() -> None:
    from ringdilated.rotary import rotary_embedding

    torch.manual_seed(0)
    m = MultiheadDilatedAttention(
        32, 4, segment_lengths=[8, 16], dilation_rates=[1, 2], causal=True,
        rotary=rotary_embedding, dtype=torch.float64,
    )  # fmt: skip
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 32, 32, dtype=torch.float64, requires_grad=True)
    out, eager = compiled(x, x, x)[0], m(x, x, x)[0]
    assert max_error(out, eager) < 1e-12
    grads = torch.autograd.grad(out.sum(), (x, *m.parameters()))
    eager_grads = torch.autograd.grad(eager.sum(), (x, *m.parameters()))
    assert max(max_error(a, b) for a, b in zip(grads, eager_grads, strict=True)) < 1e-10
    _no_graph_break()


def test_a_new_layout_per_batch_reuses_the_compiled_graph() -> None:
    """The layout is an opaque graph input: three batches of other documents, one graph, each
    equal to the oracle (forward and gradients)."""
    import ringdilated
    from ringdilated.compiled import OP_SUPPORTED

    if not OP_SUPPORTED:
        pytest.skip("this torch has no opaque types for custom ops")
    attn = DilatedAttention([8, 16], [1, 2], causal=True)
    compiled = torch.compile(attn, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(6)
    for bounds in ([0, 32], [0, 5, 32], [0, 11, 20, 32]):
        layout = ringdilated.SequenceLayout(cu_seqlens=torch.tensor(bounds))
        q, k, v = (
            torch.randn(1, 32, 4, 8, generator=g, dtype=torch.float64).requires_grad_()
            for _ in range(3)
        )
        out = compiled(q, k, v, layout=layout)
        expected = oracle(q, k, v, [8, 16], [1, 2], causal=True, cu_seqlens=torch.tensor(bounds))
        assert max_error(out, expected) < 1e-12, bounds
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
        assert max(max_error(a, b) for a, b in zip(grads, expected_grads, strict=True)) < 1e-10
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    _no_graph_break()


def test_only_the_op_that_reads_the_host_is_cudagraph_unsafe() -> None:
    ops = torch.ops.ringdilated
    assert torch.Tag.cudagraph_unsafe in ops.dilated_attention.default.tags
    assert torch.Tag.cudagraph_unsafe in ops.dilated_attention_backward.default.tags
    from ringdilated.compiled import OP_SUPPORTED

    if OP_SUPPORTED:
        assert torch.Tag.cudagraph_unsafe not in ops.attention.default.tags
        assert torch.Tag.cudagraph_unsafe not in ops.attention_backward.default.tags


# inductor's own imports warn that torch.jit.script_method is deprecated (torch's, not ours)
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_inductor_trains_on_transposed_inputs() -> None:
    """The default backend (inductor) runs a training step on (B, H, L, D)-strided inputs, as the
    Hugging Face adapter passes them: the ops' fakes give the real outputs' strides (a review
    found the backward's fake copying the inputs' strides, which inductor asserted on)."""
    torch.manual_seed(0)
    attn = DilatedAttention([8, 16], [1, 2], causal=True)
    compiled = torch.compile(attn, fullgraph=True)
    g = torch.Generator().manual_seed(7)
    q, k, v = (
        torch.randn(2, 4, 32, 8, generator=g, dtype=torch.float64)
        .transpose(1, 2)
        .requires_grad_()  # leaves strided as (B, H, L, D)
        for _ in range(3)
    )
    out = compiled(q, k, v)
    expected = oracle(q, k, v, [8, 16], [1, 2], causal=True)
    assert max_error(out, expected) < 1e-12
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    expected_grads = torch.autograd.grad(expected.sum(), (q, k, v))
    assert max(max_error(a, b) for a, b in zip(grads, expected_grads, strict=True)) < 1e-10
