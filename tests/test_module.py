"""DilatedAttention (the module), the plan, dropout, and the distributed keywords' local path."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ringdilated
from ringdilated.core.plan.window import CAUSAL
from ringdilated.core.run.local import CallState, DilatedAttentionFunction, LocalRun, RowBlocks
from ringdilated.core.select import feature_cost
from ringdilated.functional import default_resolver
from ringdilated.testing import oracle, pattern_weights


def test_module_matches_functional_and_explains_the_plan_of_its_call() -> None:
    attn = ringdilated.DilatedAttention([8, 16], [1, 2], causal=True)
    assert attn.plan is None, "no plan is guessed before a call"
    assert "chosen for the tensors of the first call (none yet)" in attn.explain()
    q = torch.randn(2, 40, 4, 8, dtype=torch.float64)
    out = attn(q, q, q)
    assert torch.allclose(out, oracle(q, q, q, [8, 16], [1, 2], causal=True), atol=1e-12, rtol=0)
    assert attn.plan is not None
    text = attn.plan.explain()
    assert "kernel: sdpa" in text and "not chosen reference" in text
    assert "float64, head_dim 8" in text
    out2, lse = attn(q, q, q, return_lse=True)
    assert torch.equal(out, out2) and lse.shape == (2, 4, 40)
    assert "segment_lengths=(8, 16)" in repr(attn)


def test_training_mode_dropout_is_served_by_a_kernel_that_declares_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On CPU the fused sdpa kernel has no dropout, so reference serves it, with a warning
    (once per process: this test starts from a process that has not warned)."""
    monkeypatch.setattr(feature_cost, "_warned", set())
    attn = ringdilated.DilatedAttention([8], [1], dropout=0.5)
    q = torch.randn(1, 16, 2, 8)
    with pytest.warns(ringdilated.SlowFeatureWarning, match=r"dropout .* 'sdpa' .* 'reference'"):
        attn(q, q, q)
    assert attn.plan is not None and attn.plan.kernel_name == "reference"
    assert "rejected sdpa: no dropout on cpu (flash attention for CPU)" in attn.plan.explain()


def test_eval_mode_drops_nothing_and_is_deterministic() -> None:
    attn = ringdilated.DilatedAttention([8], [1], dropout=0.5).eval()
    q = torch.randn(1, 16, 2, 8)
    a, b = attn(q, q, q), attn(q, q, q)
    assert torch.equal(a, b)
    assert attn.plan is not None and attn.plan.kernel_name == "sdpa", "no dropout needed"
    assert torch.allclose(a.double(), oracle(q, q, q, [8], [1]), atol=1e-5)


@pytest.mark.filterwarnings("ignore::ringdilated.SlowFeatureWarning")  # reference on CPU
@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_dropout_drops_probabilities_once_and_rescales(mode: str) -> None:
    """With v = identity, out rows are the dropped attention probabilities themselves. A key that
    c patterns select (longnet) is c terms of the multiset softmax, each P / c, each dropped on its
    own: an entry is m * P / (c * (1 - p)) for some 0 <= m <= c. head_groups has c = 1."""
    L, p = 16, 0.3
    q = torch.randn(1, L, 2, L, dtype=torch.float64)
    k = torch.randn(1, L, 2, L, dtype=torch.float64)
    v = torch.eye(L, dtype=torch.float64).view(1, L, 1, L).expand(1, L, 2, L).contiguous()
    torch.manual_seed(0)
    dropped = ringdilated.dilated_attention(q, k, v, [8, 16], [1, 2], mode=mode, dropout_p=p)
    probs = oracle(q, k, v, [8, 16], [1, 2], mode=mode)
    counts = pattern_weights(L, 2, [8, 16], [1, 2], mode=mode)[0].permute(1, 0, 2).unsqueeze(0)
    unit = probs / counts.clamp(min=1) / (1 - p)
    multiple = torch.where(unit > 0, dropped / unit, torch.zeros_like(unit))
    assert torch.allclose(multiple, multiple.round(), atol=1e-9)
    assert torch.all((multiple.round() >= 0) & (multiple.round() <= counts))
    assert torch.all(dropped[unit == 0] == 0)
    terms = float(counts.sum())
    dropped_terms = float((counts - multiple.round()).sum())
    assert 0.2 < dropped_terms / terms < 0.4, dropped_terms / terms
    torch.manual_seed(0)
    assert torch.equal(
        dropped, ringdilated.dilated_attention(q, k, v, [8, 16], [1, 2], mode=mode, dropout_p=p)
    )


@pytest.mark.parametrize("mode", ["head_groups", "longnet"])
def test_dropout_gradients_are_exact(mode: str) -> None:
    """With a fixed seed the dropped attention is a deterministic function: gradcheck it."""
    q, k, v = (torch.randn(1, 10, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    kernel = default_resolver().kernel("reference")
    blocks = ringdilated.DilationPattern([4, 8], [1, 2], mode).blocks(10, 2, 2)
    run = LocalRun(
        kernel,
        (RowBlocks(None, blocks),),
        exclusive=mode == "head_groups",
        scale=0.5,
        window=CAUSAL,
        dropout_p=0.4,
    )

    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = DilatedAttentionFunction.apply(a, b, c, run, CallState(seed=7))
        return out, lse.masked_fill(torch.isneginf(lse), 0.0)  # unselected rows: constant -inf

    torch.autograd.gradcheck(fn, (q, k, v))  # raises on a mismatch


def test_process_group_of_one_and_local_communicator(tmp_path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        q = torch.randn(1, 12, 2, 4, dtype=torch.float64)
        out = ringdilated.dilated_attention(
            q, q, q, [4], [2], process_group=dist.group.WORLD, communicator="local"
        )
        assert torch.allclose(out, oracle(q, q, q, [4], [2]), atol=1e-12, rtol=0)
        attn = ringdilated.DilatedAttention([4], [2], process_group=dist.group.WORLD)
        assert torch.equal(attn(q, q, q), out)
    finally:
        dist.destroy_process_group()


def test_chunked_execution_equals_unchunked() -> None:
    """Chunking blocks to bound memory changes nothing: tiny budgets force per-batch pieces."""
    q, k, v = (torch.randn(3, 37, 4, 8, dtype=torch.float64) for _ in range(3))
    kernel = default_resolver().kernel("sdpa")
    for mode in ("head_groups", "longnet"):
        blocks = ringdilated.DilationPattern([4, 8], [1, 2], mode).blocks(37, 4, 4)
        outs = [
            DilatedAttentionFunction.apply(
                q,
                k,
                v,
                LocalRun(
                    kernel,
                    (RowBlocks(None, blocks),),
                    exclusive=mode == "head_groups",
                    scale=0.3,
                    window=CAUSAL,
                    chunk_elements=n,
                ),
                CallState(),
            )[0]
            for n in (1, 40, 1 << 23)
        ]
        expected = oracle(q, k, v, [4, 8], [1, 2], mode=mode, causal=True, scale=0.3)
        for out in outs:
            assert torch.allclose(out, expected, atol=1e-12, rtol=0)


def test_module_explains_kernel_and_communicator() -> None:
    attn = ringdilated.DilatedAttention([8], [2])
    q = torch.randn(1, 16, 2, 8)
    attn(q, q, q)
    text = attn.explain()
    assert "kernel: sdpa" in text and "communicator: local" in text


def test_a_forced_gpu_kernel_builds_anywhere_and_is_chosen_per_call() -> None:
    """Construction checks only the name; the kernel is resolved for the tensors a call passes
    (device, dtype, head dim) and re-resolved when they change."""
    attn = ringdilated.DilatedAttention([8], [1], kernel="flash")
    mha = ringdilated.MultiheadDilatedAttention(
        64, 4, segment_lengths=[8], dilation_rates=[1], kernel="flash", dtype=torch.bfloat16
    )
    assert mha.dtype == torch.bfloat16 and mha.plan is None
    q = torch.randn(1, 16, 2, 8)
    with pytest.raises(ringdilated.ResolutionError, match=r"kernel 'flash' .* cannot serve cpu"):
        attn(q, q, q)
    x = torch.randn(1, 16, 64, dtype=torch.bfloat16)
    with pytest.raises(ringdilated.ResolutionError, match="runs on cuda, not cpu"):
        mha(x, x, x)
    auto = ringdilated.DilatedAttention([8], [1])
    auto(q, q, q)
    assert auto.plan is not None and auto.plan.request.dtype == torch.float32
    auto(q.double(), q.double(), q.double())
    assert auto.plan.request.dtype == torch.float64, "re-resolved for the new dtype"
