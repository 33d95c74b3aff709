"""MultiheadDilatedAttention and DilatedTransformerBlock against float64 references built from
the oracle; rejections; dtype='auto'; MAGNETO initialisation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.nn import functional as F

from ringdilated import DilatedTransformerBlock, MultiheadDilatedAttention
from ringdilated.auto_dtype import resolve_dtype
from ringdilated.testing import max_error, oracle

# tests.strategies.layouts() draws batches whose every row is padding on purpose (the output is
# then zeros, checked against the oracle): the PaddingMaskWarning such a mask gives is expected.
pytestmark = pytest.mark.filterwarnings("ignore:key_padding_mask .* is True at every position")


def reference(
    m: MultiheadDilatedAttention,
    x: torch.Tensor,
    causal: bool,
    mode: str,
    query: torch.Tensor | None = None,
    **layout: torch.Tensor,
) -> torch.Tensor:
    """The module's maths written out, with the float64 oracle for the attention itself
    (``query``: a suffix of ``x``'s positions; ``layout``: ``cu_seqlens``/``key_padding_mask``)."""
    b, length, e = x.shape
    query = x if query is None else query
    q_len = query.shape[1]
    q = F.linear(query, m.q_proj.weight, m.q_proj.bias).view(b, q_len, m.num_heads, m.head_dim)
    k = F.linear(x, m.k_proj.weight, m.k_proj.bias).view(b, length, m.num_kv_heads, m.head_dim)
    v = F.linear(x, m.v_proj.weight, m.v_proj.bias).view(b, length, m.num_kv_heads, m.head_dim)
    pattern = m.attention.pattern
    out = oracle(
        q, k, v, pattern.segment_lengths, pattern.dilation_rates, mode=mode, causal=causal,
        **layout,
    ).reshape(b, q_len, e)  # fmt: skip
    if m.norm is not None:
        out = F.layer_norm(out, (e,), m.norm.weight, m.norm.bias, m.norm.eps)
    return F.linear(out, m.out_proj.weight, m.out_proj.bias)


@given(
    seq_len=st.integers(1, 40),
    causal=st.booleans(),
    mode=st.sampled_from(["head_groups", "longnet"]),
    kv_heads=st.sampled_from([1, 2, 4]),
    layer_norm=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_the_oracle_forward_and_backward(
    seq_len, causal, mode, kv_heads, layer_norm, seed
) -> None:
    torch.manual_seed(seed)
    m = MultiheadDilatedAttention(
        32,
        4,
        segment_lengths=[8, 16],
        dilation_rates=[1, 2],
        num_kv_heads=kv_heads,
        mode=mode,
        causal=causal,
        layer_norm=layer_norm,
        gamma_init=0.8,
        dtype=torch.float64,
    )
    x = torch.randn(2, seq_len, 32, dtype=torch.float64, requires_grad=True)
    out, weights = m(x, x, x)
    assert weights is None
    expected = reference(m, x, causal, mode)
    assert max_error(out, expected) < 1e-10
    params = [x, *m.parameters()]
    grads = torch.autograd.grad(out.square().sum(), params)
    expected_grads = torch.autograd.grad(expected.square().sum(), params)
    assert max(max_error(a, b) for a, b in zip(grads, expected_grads, strict=True)) < 1e-9


@given(
    data=st.data(),
    causal=st.booleans(),
    mode=st.sampled_from(["head_groups", "longnet"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_documents_padding_and_a_query_suffix_match_the_oracle(
    data: st.DataObject, causal: bool, mode: str, seed: int
) -> None:
    """``key_padding_mask`` (nn.MultiheadAttention's convention), ``cu_seqlens`` and a query
    shorter than the keys, through the projections, forward and backward."""
    from tests.strategies import layouts

    torch.manual_seed(seed)
    length = data.draw(st.integers(1, 24))
    layout = data.draw(layouts(2, length))
    m = MultiheadDilatedAttention(
        16, 4, segment_lengths=[4, 8], dilation_rates=[1, 2], num_kv_heads=2, mode=mode,
        causal=causal, dtype=torch.float64,
    )  # fmt: skip
    x = torch.randn(2, length, 16, dtype=torch.float64, requires_grad=True)
    query = layout.queries(x)
    kwargs = layout.kwargs()
    out, _ = m(query, x, x, kwargs.get("key_padding_mask"), cu_seqlens=kwargs.get("cu_seqlens"))
    expected = reference(m, x, causal, mode, query, **kwargs)
    assert max_error(out, expected) < 1e-10
    params = [x, *m.parameters()]
    grads = torch.autograd.grad(out.square().sum(), params)
    expected_grads = torch.autograd.grad(expected.square().sum(), params)
    assert max(max_error(a, b) for a, b in zip(grads, expected_grads, strict=True)) < 1e-9


def test_a_padded_batch_gives_the_unpadded_results_on_valid_tokens() -> None:
    """The transformer block on right- and left-padded rows equals the block on each unpadded
    sequence alone, at every valid position."""
    torch.manual_seed(0)
    block = DilatedTransformerBlock(
        16, 4, segment_lengths=[4, 8], dilation_rates=[1, 2], causal=True, dtype=torch.float64
    )
    first, second = (
        torch.randn(1, 11, 16, dtype=torch.float64),
        torch.randn(1, 7, 16, dtype=torch.float64),
    )
    batch = torch.zeros(2, 11, 16, dtype=torch.float64)
    batch[0], batch[1, 4:] = first[0], second[0]
    mask = torch.zeros(2, 11, dtype=torch.bool)
    mask[1, :4] = True
    out = block(batch, key_padding_mask=mask)
    assert max_error(out[0], block(first)[0]) < 1e-12
    assert max_error(out[1, 4:], block(second)[0]) < 1e-12
    packed = block(torch.cat([first, second], 1), cu_seqlens=torch.tensor([0, 11, 18]))
    assert max_error(packed[0, :11], block(first)[0]) < 1e-12
    assert max_error(packed[0, 11:], block(second)[0]) < 1e-12


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"need_weights": True}, ValueError, "need_weights=True is not supported"),
        ({"attn_mask": torch.zeros(8, 8)}, ValueError, "attn_mask is not supported yet"),
        (
            {"key_padding_mask": torch.zeros(1, 8, dtype=torch.int64)},
            TypeError,
            "key_padding_mask must be a bool tensor",
        ),
        ({"is_causal": True}, ValueError, "is_causal=True needs a module built with causal=True"),
    ],
)
def test_unsupported_arguments_raise(kwargs, error, message) -> None:
    m = MultiheadDilatedAttention(16, 2, segment_lengths=[8], dilation_rates=[1])
    x = torch.randn(1, 8, 16)
    with pytest.raises(error, match=message):
        m(x, x, x, **kwargs)


def test_bad_construction_and_inputs_raise() -> None:
    with pytest.raises(TypeError):
        MultiheadDilatedAttention(16, 2, [8], [1])  # type: ignore[misc]  # keyword-only pattern
    with pytest.raises(ValueError, match=r"embed_dim \(10\) must be divisible by num_heads \(4\)"):
        MultiheadDilatedAttention(10, 4, segment_lengths=[8], dilation_rates=[1])
    with pytest.raises(ValueError, match=r"num_kv_heads \(3\) must divide num_heads \(4\)"):
        MultiheadDilatedAttention(16, 4, segment_lengths=[8], dilation_rates=[1], num_kv_heads=3)
    with pytest.raises(ValueError, match="dilation_rates"):
        MultiheadDilatedAttention(16, 2, segment_lengths=[8, 16], dilation_rates=[1])
    with pytest.raises(TypeError, match=r"dtype must be 'auto', None or a floating torch\.dtype"):
        MultiheadDilatedAttention(16, 2, segment_lengths=[8], dilation_rates=[1], dtype=torch.int32)
    m = MultiheadDilatedAttention(16, 2, segment_lengths=[8], dilation_rates=[1])
    x64 = torch.randn(1, 8, 16, dtype=torch.float64)
    with pytest.raises(
        TypeError, match=r"query is torch.float64 but the module's parameters are torch.float32"
    ):
        m(x64, x64, x64)
    with pytest.raises(ValueError, match=r"batch"):
        m(torch.randn(2, 8, 16), torch.randn(1, 8, 16), torch.randn(1, 8, 16))
    with pytest.raises(
        ValueError, match=r"query must be \(batch, seq_len, embed_dim=16\), got \(8, 16\)"
    ):
        m(torch.randn(8, 16), torch.randn(8, 16), torch.randn(8, 16))


def test_dtype_auto_is_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    m = MultiheadDilatedAttention(16, 2, segment_lengths=[8], dilation_rates=[1])
    assert {p.dtype for p in m.parameters()} == {torch.float32}  # CPU: float32
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "7.5")
    assert resolve_dtype("auto", "cuda") == torch.float16
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "6.1")
    assert resolve_dtype("auto", "cuda") == torch.float32
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "9.0")
    assert resolve_dtype("auto", "cuda:0") == torch.bfloat16
    bf16 = MultiheadDilatedAttention(
        16, 2, segment_lengths=[8], dilation_rates=[1], dtype=torch.bfloat16
    )
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    x = torch.randn(1, 8, 16, dtype=torch.bfloat16)
    assert bf16(x, x, x)[0].dtype == torch.bfloat16


def test_projections_get_magneto_xavier_gains_and_zero_biases() -> None:
    torch.manual_seed(0)
    m = MultiheadDilatedAttention(
        512, 8, segment_lengths=[8], dilation_rates=[1], gamma_init=2.0, num_kv_heads=2
    )
    xavier = lambda w: (2.0 / sum(w.shape)) ** 0.5  # noqa: E731
    for proj, gain in ((m.q_proj, 1.0), (m.k_proj, 1.0), (m.v_proj, 2.0), (m.out_proj, 2.0)):
        std = float(proj.weight.detach().std())
        assert abs(std / (gain * xavier(proj.weight)) - 1) < 0.05, (proj, std)
        assert proj.bias is not None and not proj.bias.any()


def test_block_matches_its_definition() -> None:
    torch.manual_seed(1)
    block = DilatedTransformerBlock(
        32,
        4,
        segment_lengths=[8, 16],
        dilation_rates=[1, 2],
        ffn_dim=48,
        causal=True,
        dtype=torch.float64,
    )
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    h = block.attn_norm(x)
    y = x + reference(block.attn, h, True, "head_groups")
    expected = y + block.ffn(block.ffn_norm(y))
    assert max_error(block(x), expected) < 1e-10


def test_block_resolves_its_kernel_for_the_call() -> None:
    block = DilatedTransformerBlock(
        32, 4, segment_lengths=[8, 16], dilation_rates=[1, 2], causal=True, dtype=torch.float64
    )
    assert "MultiheadDilatedAttention" in repr(block)
    assert block.attn.plan is None, "no plan before the first call"
    block(torch.randn(1, 16, 32, dtype=torch.float64))
    plan = block.attn.plan
    assert plan is not None
    request = plan.request
    assert (request.dtype, request.head_dim, request.causal) == (torch.float64, 8, True), request


def test_rotary_embedding_is_the_rope_formula() -> None:
    """Half-split RoPE: pair (x_i, x_{i+D/2}) turns by position * 10000^(-2i/D)."""
    from ringdilated.rotary import rotary_embedding

    x = torch.randn(1, 5, 2, 6, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 7, 3]])
    out = rotary_embedding(x, positions)
    for b, p in enumerate(positions[0].tolist()):
        for i in range(3):
            angle = p * 10000.0 ** (-2 * i / 6)
            c, s = (
                torch.cos(torch.tensor(angle, dtype=torch.float64)),
                torch.sin(torch.tensor(angle, dtype=torch.float64)),
            )
            a, bb = x[0, b, :, i], x[0, b, :, i + 3]
            assert torch.allclose(out[0, b, :, i], a * c - bb * s, atol=1e-12)
            assert torch.allclose(out[0, b, :, i + 3], bb * c + a * s, atol=1e-12)


def test_rotary_positions_restart_per_document_and_continue_in_the_cache() -> None:
    """With rotary=, packed documents and padded rows equal each sequence alone (positions
    restart at each document), and cached decoding equals the full call."""
    from ringdilated.rotary import rotary_embedding

    torch.manual_seed(0)
    m = MultiheadDilatedAttention(
        16, 4, segment_lengths=[4, 8], dilation_rates=[1, 2], num_kv_heads=2, causal=True,
        dtype=torch.float64, rotary=rotary_embedding,
    )  # fmt: skip
    first, second = (
        torch.randn(1, 7, 16, dtype=torch.float64),
        torch.randn(1, 5, 16, dtype=torch.float64),
    )
    alone = [m(x, x, x)[0] for x in (first, second)]
    packed = torch.cat([first, second], 1)
    out, _ = m(packed, packed, packed, cu_seqlens=torch.tensor([0, 7, 12]))
    assert max_error(out[:, :7], alone[0]) < 1e-12 and max_error(out[:, 7:], alone[1]) < 1e-12
    padded = torch.zeros(2, 7, 16, dtype=torch.float64)
    padded[0], padded[1, 2:] = first[0], second[0]
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, :2] = True
    out, _ = m(padded, padded, padded, mask)
    assert max_error(out[0], alone[0][0]) < 1e-12 and max_error(out[1, 2:], alone[1][0]) < 1e-12
    cache = m.make_cache()
    steps = [m(first[:, :3], first[:, :3], first[:, :3], cache=cache)[0]]
    steps += [m(first[:, t : t + 1], first[:, t : t + 1], first[:, t : t + 1], cache=cache)[0]
              for t in range(3, 7)]  # fmt: skip
    assert max_error(torch.cat(steps, 1), alone[0]) < 1e-12
    # and rotary matters: without it the results differ
    plain = MultiheadDilatedAttention(
        16, 4, segment_lengths=[4, 8], dilation_rates=[1, 2], num_kv_heads=2, causal=True,
        dtype=torch.float64,
    )  # fmt: skip
    plain.load_state_dict(m.state_dict())
    assert max_error(plain(first, first, first)[0], alone[0]) > 1e-6
