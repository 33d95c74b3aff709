"""Grouped-query heads through the memory-efficient kernels (``xformers`` and the ``sdpa`` CUDA
path), run on CPU against their stand-ins: the conformance kit's own checks on chosen grouped
cases (4 query heads on 2 and on 1 key/value heads, strided views, causal offsets that take
two bottom-right pieces, rows that see no key), and the upstream preconditions the stand-ins
enforce for the layouts those kernels use (xformers 0.0.35's BMGHK forward, its BMHK-only
backward, torch's equal head counts). That nothing is repeated on the way to the ops is checked
on FakeTensor ``cuda`` tensors in tests/test_fake_cuda_grouped_heads.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from ringdilated.backends import _heads, sdpa
from ringdilated.backends.sdpa import EfficientAttention
from ringdilated.backends.xformers import XformersKernel
from ringdilated.core import KeyWindow
from ringdilated.core.contract.causal import bottom_right_pieces
from ringdilated.testing import conformance
from ringdilated.testing.kernel_cases import KernelCase
from tests.standins import efficient_attention, efficient_attention_backward, install_xformers
from tests.standins.mem_efficient import cutlass_backward, cutlass_forward

Q_LEN, K_LEN = 12, 16
#: ``None``: unmasked; 6: two bottom-right pieces (rows 0-9 causal on all keys, 10-11 see every
#: key); -3: the first three rows see no key, the rest one causal piece on 13 keys.
OFFSETS = (None, 6, -3)
CHECKS = ("causal", "gradients", "split-merge", "non-finite", "non-finite-gradients")


@pytest.fixture(autouse=True)
def _grouped_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every grouped call here goes one call per key/value head, however small (the size rule
    that repeats small calls instead is tested in tests/test_heads_grouping.py)."""
    monkeypatch.setattr(_heads, "GROUPED_MIN_TILES", 0)


def test_the_chosen_offsets_take_the_pieces_named() -> None:
    pieces = [len(bottom_right_pieces(Q_LEN, K_LEN, offset)) for offset in OFFSETS]
    assert pieces == [1, 2, 1]


def _case(kv_heads: int, offset: int | None, dtype: torch.dtype, seed: int) -> KernelCase:
    return KernelCase(
        n=2, heads=4, kv_heads=kv_heads, q_len=Q_LEN, k_len=K_LEN, head_dim=16, dtype=dtype,
        scale=0.3, window=KeyWindow(None, offset), seed=seed, layout="strided", rate=2, offset=1,
    )  # fmt: skip


def _xformers(monkeypatch: pytest.MonkeyPatch) -> Any:
    install_xformers(monkeypatch)
    return XformersKernel()


def _sdpa(monkeypatch: pytest.MonkeyPatch) -> Any:
    return EfficientAttention(efficient_attention, efficient_attention_backward)


KERNELS: dict[str, Callable[[pytest.MonkeyPatch], Any]] = {"xformers": _xformers, "sdpa": _sdpa}


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("name", list(KERNELS))
def test_grouped_heads_pass_the_kits_checks(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    kv_heads: int,
    offset: int | None,
    dtype: torch.dtype,
) -> None:
    """Forward against the float64 oracle, gradients (the per-query-head ``dk``, ``dv`` the op
    returns summed over each group), two blocks merged, and the non-finite rule."""
    kernel = KERNELS[name](monkeypatch)
    case = _case(kv_heads, offset, dtype, seed=kv_heads * 100 + (offset or 0))
    for check in CHECKS:
        conformance._RUNNERS[check](kernel, case, True)


@pytest.mark.parametrize("kv_heads", [2, 1])
@pytest.mark.parametrize("offset", OFFSETS)
def test_sdpa_grouped_dropout_replays_each_calls_mask(kv_heads: int, offset: int | None) -> None:
    """With dropout each key/value head's call draws its own mask from the one seeded generator;
    the backward replays each from the offset that call drew at (the kit's dropout check reads
    the masks back and judges the gradients under them)."""
    kernel = EfficientAttention(efficient_attention, efficient_attention_backward)
    conformance._RUNNERS["dropout"](kernel, _case(kv_heads, offset, torch.float16, 7), True)


def test_a_backward_replaying_every_group_from_offset_0_fails_the_dropout_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check above is not vacuous: group 1 drew at a later offset than group 0."""
    monkeypatch.setattr(sdpa, "philox_increment", lambda count: 0)
    kernel = EfficientAttention(efficient_attention, efficient_attention_backward)
    with pytest.raises(conformance.ConformanceError, match=r"\[dropout\] d[qkv] under the mask"):
        conformance._RUNNERS["dropout"](kernel, _case(2, None, torch.float16, 7), True)


def test_a_wrong_group_mapping_fails_the_kits_forward_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Query head ``h`` must read key/value head ``h // r``: handing group ``g`` the next key/value
    head is caught by the oracle (the checks above are not blind to the grouping)."""

    def shifted(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, ...]:
        groups = _heads.kv_groups(q, k, v)
        nexts = groups[1:] + groups[:1]
        return tuple(
            _heads.HeadGroup(g.index, g.first, g.kv_heads, g.q, n.k, n.v)
            for g, n in zip(groups, nexts, strict=True)
        )

    monkeypatch.setattr(sdpa, "kv_groups", shifted)
    kernel = EfficientAttention(efficient_attention, efficient_attention_backward)
    with pytest.raises(conformance.ConformanceError, match=r"\[causal\] out"):
        conformance._RUNNERS["causal"](kernel, _case(2, 6, torch.float32, 3), True)


# -- the stand-ins enforce upstream's preconditions for these layouts -----------------------------


def _fmha(monkeypatch: pytest.MonkeyPatch) -> Any:
    install_xformers(monkeypatch)
    import xformers.ops.fmha as fmha  # the stand-in

    return fmha


def _bmghk(kv_heads: int = 2, expand: bool = True) -> tuple[torch.Tensor, ...]:
    """``q (1, 8, G, 2, 16)``, and ``k``, ``v`` with one head per group, expanded or not."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 8, kv_heads, 2, 16, generator=g)
    k, v = (torch.randn(1, 8, kv_heads, 1, 16, generator=g) for _ in "kv")
    if expand:
        k, v = (x.expand(-1, -1, -1, 2, -1) for x in (k, v))
    return q, k, v


def test_xformers_forward_takes_bmghk_with_expanded_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    fmha = _fmha(monkeypatch)
    q, k, v = _bmghk()
    assert k.stride(3) == 0
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(
        q, k, v, scale=0.25, op=fmha.cutlass.FwOp
    )
    assert out.shape == q.shape and lse.shape == (1, 2, 2, 32)
    reference = torch.softmax(torch.einsum("bmghd,bnghd->bghmn", q.double(), k.double()) * 0.25, -1)
    expected = torch.einsum("bghmn,bnghd->bmghd", reference, v.double())
    assert torch.allclose(out.double(), expected, atol=1e-5)


def test_xformers_refuses_keys_not_expanded_to_the_query_heads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``validate_inputs``: no broadcasting, the caller expands."""
    fmha = _fmha(monkeypatch)
    q, k, v = _bmghk(expand=False)
    with pytest.raises(ValueError, match="please use `expand` yourself"):
        fmha.memory_efficient_attention_forward_requires_grad(q, k, v, op=fmha.cutlass.FwOp)


def test_xformers_backward_refuses_bmghk(monkeypatch: pytest.MonkeyPatch) -> None:
    """``cutlass.BwOp`` does not declare ``SUPPORTS_BMGHK``: the backward takes BMHK only, which
    is why the wrapper runs it once per key/value head."""
    fmha = _fmha(monkeypatch)
    q, k, v = _bmghk()
    out, lse = fmha.memory_efficient_attention_forward_requires_grad(q, k, v, op=fmha.cutlass.FwOp)
    with pytest.raises(ValueError, match="operator does not support BMGHK format"):
        fmha.memory_efficient_attention_backward(out, out, lse, q, k, v, op=fmha.cutlass.BwOp)


def test_the_ops_refuse_unequal_head_counts() -> None:
    """``attention.cu``/``attention_backward.cu``: ``query.size(2) == key.size(2)``: grouped heads
    reach the op expanded, never as fewer heads."""
    q = torch.randn(1, 8, 4, 16)
    k = torch.randn(1, 8, 2, 16)
    lse = torch.zeros(1, 4, 32)
    with pytest.raises(RuntimeError, match="key shape"):
        cutlass_forward(q, k, k, None, None, None, None, None, 0.0, 0, True)
    with pytest.raises(RuntimeError, match="key shape"):
        cutlass_backward(q, q, k, k, None, q, None, None, 8, 8, lse, 0.0, lse, lse, 0, False)


def test_the_op_reads_an_expanded_key_through_its_strides() -> None:
    """A key/value head expanded along heads (stride 0) is read once per query head: the same
    numbers as the repeated copy, and the backward returns one ``dk`` per query head."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 8, 4, 16, generator=g)
    k, v = (torch.randn(2, 8, 1, 16, generator=g) for _ in "kv")
    expanded = [x.expand(-1, -1, 4, -1) for x in (k, v)]
    repeated = [x.repeat_interleave(4, 2) for x in (k, v)]
    out, lse, *_ = cutlass_forward(q, *expanded, None, None, None, None, None, 0.0, 2, True)
    same, same_lse, *_ = cutlass_forward(q, *repeated, None, None, None, None, None, 0.0, 2, True)
    assert torch.equal(out, same) and torch.equal(lse, same_lse)
    dout = torch.randn(out.shape, generator=g)
    grads = cutlass_backward(dout, q, *expanded, None, out, None, None, 8, 8, lse, 0.0, lse, lse,
                             2, False)  # fmt: skip
    assert grads[1].shape == (2, 8, 4, 16) and grads[1].is_contiguous()
    assert torch.equal(grads[1], cutlass_backward(dout, q, *repeated, None, out, None, None, 8, 8,
                                                  lse, 0.0, lse, lse, 2, False)[1])  # fmt: skip


def _odd_case(seed: int) -> KernelCase:
    """One problem, 6 query heads on 2: each group's call draws ``1 * 3 * 5 * 7 = 105`` numbers,
    which the generator rounds up to 108 (``CUDAGeneratorImpl.cpp``: ``(increment + 3) / 4 *
    4``), so group 1's offset is 108, not 105."""
    return KernelCase(
        n=1, heads=6, kv_heads=2, q_len=5, k_len=7, head_dim=16, dtype=torch.float16,
        scale=0.3, window=KeyWindow(), seed=seed, layout="contiguous",
    )  # fmt: skip


def test_sdpa_grouped_dropout_replays_offsets_rounded_up_to_4() -> None:
    kernel = EfficientAttention(efficient_attention, efficient_attention_backward)
    conformance._RUNNERS["dropout"](kernel, _odd_case(11), True)


def test_a_backward_replaying_unrounded_offsets_fails_the_dropout_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without the rounding, group 1 replays from 105 where its forward drew from 108."""
    monkeypatch.setattr(sdpa, "philox_increment", lambda count: count)
    kernel = EfficientAttention(efficient_attention, efficient_attention_backward)
    with pytest.raises(conformance.ConformanceError, match=r"\[dropout\] d[qkv] under the mask"):
        conformance._RUNNERS["dropout"](kernel, _odd_case(11), True)
