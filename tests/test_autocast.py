"""Under torch.autocast (CPU bfloat16 here), dilated attention follows scaled_dot_product_
attention's policy: it computes in the autocast dtype and returns it; the modules take
activations in it; a few training steps under autocast track the float32 run."""

from __future__ import annotations

import pytest
import torch

import ringdilated
from ringdilated.testing import assert_within_tolerance, dense_attention, oracle


def _qkv(requires_grad: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 32, 4, 8, generator=g).requires_grad_(requires_grad) for _ in range(3)]


@pytest.mark.parametrize("kernel", ["sdpa", "reference"])
def test_attention_computes_in_the_autocast_dtype_and_returns_it(kernel: str) -> None:
    q, k, v = _qkv(requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ringdilated.dilated_attention(q, k, v, [8, 16], [1, 2], causal=True, kernel=kernel)
    assert out.dtype == torch.bfloat16
    explicit = ringdilated.dilated_attention(
        *(x.detach().bfloat16() for x in (q, k, v)), [8, 16], [1, 2], causal=True, kernel=kernel
    )
    assert torch.equal(out.detach(), explicit), "the same as passing bfloat16 inputs"
    half = [x.detach().bfloat16() for x in (q, k, v)]
    expected = oracle(*half, [8, 16], [1, 2], causal=True)
    baseline, _ = dense_attention(*half, [8, 16], [1, 2], causal=True)
    assert_within_tolerance(out, expected, baseline, what="out under autocast")
    out.float().square().sum().backward()
    assert all(x.grad is not None and x.grad.dtype == torch.float32 for x in (q, k, v))


def test_float64_is_left_alone_as_autocast_leaves_it() -> None:
    """Autocast casts float32 and lower only; a float64 call keeps its precision."""
    q, k, v = (x.double() for x in _qkv())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ringdilated.dilated_attention(q, k, v, [8, 16], [1, 2])
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    assert out.dtype == reference.dtype == torch.float64
    assert float((out - oracle(q, k, v, [8, 16], [1, 2])).abs().max()) < 1e-12


def test_compiled_attention_follows_autocast_too() -> None:
    torch._dynamo.reset()
    attn = torch.compile(ringdilated.DilatedAttention([8, 16], [1, 2]), backend="aot_eager")
    q, k, v = _qkv()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attn(q, k, v)
    assert out.dtype == torch.bfloat16
    explicit = ringdilated.dilated_attention(*(x.bfloat16() for x in (q, k, v)), [8, 16], [1, 2])
    assert torch.equal(out, explicit)
    torch._dynamo.reset()


def test_multihead_attention_takes_autocast_activations() -> None:
    mha = ringdilated.MultiheadDilatedAttention(
        32, 4, segment_lengths=[8, 16], dilation_rates=[1, 2], dtype=torch.float32
    )
    x = torch.randn(2, 32, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = torch.nn.Linear(32, 32)(x)  # an earlier layer's bfloat16 output
        assert half.dtype == torch.bfloat16
        out, _ = mha(half, half, half)
    assert out.dtype == torch.bfloat16
    with pytest.raises(TypeError, match=r"torch\.bfloat16 but the module's parameters are"):
        mha(half.detach(), half.detach(), half.detach())  # outside autocast: still refused


def test_training_under_autocast_tracks_the_float32_run() -> None:
    """Five steps of a tiny causal model: the bfloat16-autocast losses stay within bfloat16's
    precision of the float32 losses, and both fall."""
    losses = {}
    for precision in ("float32", "autocast"):
        torch.manual_seed(0)
        block = ringdilated.DilatedTransformerBlock(
            32, 4, segment_lengths=[8, 16], dilation_rates=[1, 2], causal=True, dtype=torch.float32
        )
        head = torch.nn.Linear(32, 32)
        params = [*block.parameters(), *head.parameters()]
        optimizer = torch.optim.SGD(params, lr=0.05)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(2, 32, 32, generator=g)
        target = torch.randn(2, 32, 32, generator=g)
        history = []
        for _ in range(5):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "autocast"):
                loss = torch.nn.functional.mse_loss(head(block(x)).float(), target)
            loss.backward()
            optimizer.step()
            history.append(loss.item())
        losses[precision] = history
    assert losses["float32"][-1] < losses["float32"][0]
    assert losses["autocast"][-1] < losses["autocast"][0]
    for a, b in zip(losses["float32"], losses["autocast"], strict=True):
        assert abs(a - b) <= 3e-2 * abs(a), (losses["float32"], losses["autocast"])
