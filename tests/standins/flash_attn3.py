"""A stand-in ``flash_attn_interface`` (FlashAttention 3, ``hopper/`` of Dao-AILab/flash-attention)
for each interface the ``flash3`` kernel supports, run on CPU in float64, and one it does not.

Read at the tags that ship ``hopper/``: ``v2.7.4.post1`` and ``v2.8.3`` (version 3.0.0b1, plain
functions whose optional inputs have no default; the forward returns ``(out, softmax_lse,
out_accum, softmax_lse_accum)``, the backward ``(dq, dk, dv, softmax_d)``), ``fa4-v4.0.0.beta27``
(3.0.0: ``torch.library`` custom ops with ``register_fake``, every optional input defaulted, the
backward's flag named ``is_causal``, returning ``softmax_d``) and ``v2.7.0`` (the 2024 interface,
``window_size`` required: unsupported). The checks are ``flash_api.cpp``'s ``TORCH_CHECK``s
(dtypes, contiguous last dimension, ``CHECK_SHAPE``, head dim a multiple of 8 and at most 256,
``num_heads_k`` dividing ``num_heads``; 3.0.0's refusal of a deterministic backward above head
dim 192) and what the hardware imposes: every input a TMA tensor map reads must start 16-byte
aligned and step by multiples of 16 bytes. ``softmax_lse`` is read as the backward reads it, by
address as dense float32 ``(b, h, seqlen_q)``, an lse of ``-inf`` taken as ``0``
(``flash_bwd_preprocess_kernel.h``). Builds before 3.0.0 deadlock in the deterministic
grouped-query backward; the stand-in raises instead. The window (the ``window_size`` pair, or
``window_size_left``/``_right``) and ``causal`` become a mask as ``mha_fwd``/``mha_bwd`` rewrite
them (:func:`tests.standins.flash_windows.fa3_visible`: bottom-right, ``left >= seqlen_k - 1``
and ``right >= seqlen_q - 1`` dropped), and ``softcap`` caps every score forward and backward
(its ``Has_softcap`` kernels).

Inputs on a ``cuda`` device (FakeTensor ``cuda`` tensors in a CPU-only torch) are checked the
same way and recorded, not computed: the forward returns empty results of the real shapes. Every
call's arguments are recorded in :data:`CALLS`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

from tests.standins.distributions import fake_distributions
from tests.standins.flash_windows import fa3_visible
from tests.standins.math import attend, grads
from tests.standins.memory import read_as

__all__ = ["CALLS", "INTERFACES", "UNSUPPORTED", "install_flash_attn3"]

#: The interfaces the kernel supports, by the tag they were read at (3.0.0: the custom ops).
INTERFACES = ("v2.7.4.post1", "v2.8.3", "3.0.0")
UNSUPPORTED = "v2.7.0"
#: The ``flash_attn_3`` distribution each is installed as (``None``: under another name).
_DISTRIBUTION = {"v2.7.4.post1": None, "v2.8.3": "3.0.0b1", "3.0.0": "3.0.0", "v2.7.0": None}
_HALF = (torch.float16, torch.bfloat16)
T = torch.Tensor  # the custom ops' annotations, evaluated at module scope
#: One entry per call: ``{"op", "tensors": {name: (shape, stride, offset, dtype)}, flags}``.
CALLS: list[dict[str, Any]] = []


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)  # TORCH_CHECK raises RuntimeError


def maybe_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _layout(x: torch.Tensor) -> tuple[Any, ...]:
    return (tuple(x.shape), x.stride(), x.storage_offset(), x.dtype)


def _check_tensor_map(name: str, x: torch.Tensor) -> None:
    """``cuTensorMapEncodeTiled``: a 16-byte aligned global address, strides multiples of 16."""
    size = x.element_size()
    steps = [s * size for n, s in zip(x.shape[:-1], x.stride()[:-1], strict=True) if n > 1]
    if (x.storage_offset() * size) % 16 or any(step % 16 for step in steps):
        raise RuntimeError(f"{name}: TMA descriptor needs 16-byte alignment (stand-in)")


def _round_up_headdim(d: int) -> int:
    return next(r for r in (64, 96, 128, 192, 256) if d <= r) if d <= 256 else 256


def _mha_fwd(q, k, v, softmax_scale, causal, window, softcap, unused):  # type: ignore[no-untyped-def]
    assert all(x is None for x in unused.values()), f"not what we call: {unused}"
    _check(q.dtype in _HALF, "FlashAttention only supports fp16, bf16, and fp8_e4m3 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    for x in (q, k, v):
        _check(x.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(h % hk == 0, "Number of heads in key/value must divide number of heads in query")
    _check(tuple(k.shape) == (b, sk, hk, d), "k must have shape (batch_size_k, seqlen_k, ...)")
    _check(tuple(v.shape) == (b, sk, hk, d), "v must have shape (batch_size_k, seqlen_k, ...)")
    _check(d % 8 == 0, "head_size should be a multiple of 8")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor_map(name, x)
    tensors = {"q": _layout(q), "k": _layout(k), "v": _layout(v)}
    flags = {"causal": causal, "window": tuple(window), "softcap": softcap}
    CALLS.append({"op": "forward", "tensors": tensors, **flags})
    if q.device.type != "cpu":  # a fake cuda tensor: shapes only
        # new_empty, not torch.empty(device=...): inside a custom op's fake implementation only
        # a method of a fake tensor makes another.
        return q.new_empty(b, sq, h, d), q.new_empty(b, h, sq, dtype=torch.float32)
    visible = fa3_visible(sq, sk, causal, *window)
    out, lse = attend(q, k, v, softmax_scale, visible, softcap=softcap)
    lse = lse.masked_fill(torch.isnan(lse), float("-inf"))  # softmax.h: a NaN sum gives -inf
    return out.to(q.dtype), lse.float()


def _mha_bwd(  # type: ignore[no-untyped-def]
    interface, dout, q, k, v, out, softmax_lse, dq, dk, dv, unused, softmax_scale, causal, window,
    softcap, deterministic,
) -> torch.Tensor:  # fmt: skip
    assert all(x is None for x in unused.values()), f"not what we call: {unused}"
    _check(q.dtype in _HALF, "FlashAttention only support fp16 and bf16 data type")
    for name, x in (("key", k), ("value", v), ("out", out), ("dout", dout)):
        _check(x.dtype == q.dtype, f"query and {name} must have the same dtype")
    for x in (q, k, v, out, dout):
        _check(x.stride(-1) == 1, "tensor must have contiguous last dimension")
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    _check(d % 8 == 0, "head_size should be a multiple of 8")
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(h % hk == 0, "Number of heads in key/value must divide number of heads in query")
    if interface == "3.0.0":
        message = "Deterministic backward not supported for hdim 256."
        _check(not deterministic or _round_up_headdim(d) < 256, message)
    elif deterministic and h != hk:
        raise RuntimeError("stand-in: this build's deterministic GQA backward deadlocks")
    for x, shape in ((out, q.shape), (dout, q.shape), (k, (b, sk, hk, d)), (v, (b, sk, hk, d))):
        _check(tuple(x.shape) == tuple(shape), "CHECK_SHAPE")
    for name, g, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        _check(g.dtype == q.dtype, f"{name} must have the same dtype as q")
        _check(g.stride(-1) == 1, f"{name} must have contiguous last dimension")
        _check(g.shape == like.shape, "CHECK_SHAPE")
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout)):
        _check_tensor_map(name, x)
    tensors = {
        name: _layout(x) for name, x in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out))
    }
    tensors["softmax_lse"] = _layout(softmax_lse)
    flags = {"causal": causal, "window": tuple(window), "softcap": softcap}
    CALLS.append({"op": "backward", "tensors": tensors, "deterministic": deterministic, **flags})
    softmax_d = q.new_zeros(b, h, -(-sq // 128) * 128, dtype=torch.float32)
    if q.device.type != "cpu":
        return softmax_d
    lse = read_as(softmax_lse, (b, h, sq), (h * sq, sq, 1), torch.float32)
    lse = lse.masked_fill(torch.isneginf(lse), 0.0)  # lse_log2 = lse == -inf ? 0 : ...
    visible = fa3_visible(sq, sk, causal, *window)
    computed = grads(dout, q, k, v, out, lse, softmax_scale, visible, softcap=softcap)
    for buffer, grad in zip((dq, dk, dv), computed, strict=True):
        buffer.copy_(grad)
    return softmax_d


def _functions_v2_7_4() -> tuple[Any, Any]:
    def _flash_attn_forward(
        q, k, v, k_new, v_new, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
        seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
        rotary_sin, q_descale, k_descale, v_descale, softmax_scale, causal, window_size=(-1, -1),
        sink_token_length=0, softcap=0.0, rotary_interleaved=True, num_splits=1, pack_gqa=None,
        sm_margin=0,
    ):  # type: ignore[no-untyped-def]  # fmt: skip
        assert sink_token_length == 0, "sink_token_length not supported yet"
        q, k = maybe_contiguous(q), maybe_contiguous(k)
        v = v.contiguous() if v.stride(-1) != 1 and v.stride(-3) != 1 else v
        unused = {"k_new": k_new, "v_new": v_new, "out": out, "cu_seqlens_q": cu_seqlens_q,
                  "page_table": page_table, "q_descale": q_descale}  # fmt: skip
        o, lse = _mha_fwd(q, k, v, softmax_scale, causal, tuple(window_size), softcap, unused)
        return (o, lse, None, None)

    def _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
        max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
        sink_token_length=0, softcap=0.0, deterministic=False, sm_margin=0,
    ):  # type: ignore[no-untyped-def]  # fmt: skip
        assert sink_token_length == 0, "sink_token_length not supported yet"
        dout, q, k, v, out = (maybe_contiguous(x) for x in (dout, q, k, v, out))
        unused = {"cu_seqlens_q": cu_seqlens_q, "sequed_k": sequed_k, "max_seqlen_q": max_seqlen_q}
        softmax_d = _mha_bwd(
            "v2.7.4.post1", dout, q, k, v, out, softmax_lse, dq, dk, dv, unused, softmax_scale,
            causal, tuple(window_size), softcap, deterministic,
        )  # fmt: skip
        return dq, dk, dv, softmax_d

    return _flash_attn_forward, _flash_attn_backward


def _functions_v2_8_3() -> tuple[Any, Any]:
    def _flash_attn_forward(
        q, k, v, k_new, v_new, qv, out, cu_seqlens_q, cu_seqlens_k, cu_seqlens_k_new, seqused_q,
        seqused_k, max_seqlen_q, max_seqlen_k, page_table, kv_batch_idx, leftpad_k, rotary_cos,
        rotary_sin, seqlens_rotary, q_descale, k_descale, v_descale, softmax_scale, causal,
        window_size=(-1, -1), attention_chunk=0, softcap=0.0, rotary_interleaved=True,
        scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0,
    ):  # type: ignore[no-untyped-def]  # fmt: skip
        q, k = maybe_contiguous(q), maybe_contiguous(k)
        v = v.contiguous() if v.stride(-1) != 1 and v.stride(-3) != 1 else v
        assert attention_chunk == 0, "not what we call"
        unused = {"k_new": k_new, "qv": qv, "out": out, "seqused_k": seqused_k,
                  "seqlens_rotary": seqlens_rotary, "v_descale": v_descale}  # fmt: skip
        o, lse = _mha_fwd(q, k, v, softmax_scale, causal, tuple(window_size), softcap, unused)
        return o, lse, None, None

    def _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, cu_seqlens_q, cu_seqlens_k, sequed_q, sequed_k,
        max_seqlen_q, max_seqlen_k, dq, dk, dv, softmax_scale, causal, window_size=(-1, -1),
        softcap=0.0, deterministic=False, sm_margin=0,
    ):  # type: ignore[no-untyped-def]  # fmt: skip
        dout, q, k, v, out = (maybe_contiguous(x) for x in (dout, q, k, v, out))
        unused = {"cu_seqlens_k": cu_seqlens_k, "sequed_q": sequed_q, "max_seqlen_k": max_seqlen_k}
        softmax_d = _mha_bwd(
            "v2.8.3", dout, q, k, v, out, softmax_lse, dq, dk, dv, unused, softmax_scale, causal,
            tuple(window_size), softcap, deterministic,
        )  # fmt: skip
        return dq, dk, dv, softmax_d

    return _flash_attn_forward, _flash_attn_backward


def _functions_v2_7_0() -> tuple[Any, Any]:
    """The 2024 interface (``hopper/`` at ``v2.7.0``), which the kernel does not support."""

    def _flash_attn_forward(
        q, k, v, softmax_scale, causal, window_size, descale_q=None, descale_k=None,
        descale_v=None, gqa_parallel=False,
    ):  # type: ignore[no-untyped-def]  # fmt: skip
        raise AssertionError("never called: the kernel refuses this interface")

    def _flash_attn_backward(
        dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal, window_size,
        deterministic=False,
    ):  # type: ignore[no-untyped-def]  # fmt: skip
        raise AssertionError("never called: the kernel refuses this interface")

    return _flash_attn_forward, _flash_attn_backward


_OPS: dict[str, tuple[Any, Any]] = {}


def _custom_ops() -> tuple[Any, Any]:
    """3.0.0: ``flash_attn_3::_flash_attn_forward`` and ``_flash_attn_backward``, registered once
    under a stand-in namespace, with fake implementations (upstream registers both)."""
    if "3.0.0" in _OPS:
        return _OPS["3.0.0"]
    namespace = "flash_attn3_standin_3_0_0"

    @torch.library.custom_op(f"{namespace}::_flash_attn_forward", mutates_args=())
    def _flash_attn_forward(
        q: T, k: T, v: T, k_new: T | None = None, v_new: T | None = None, qv: T | None = None,
        out_: T | None = None, cu_seqlens_q: T | None = None, cu_seqlens_k: T | None = None,
        cu_seqlens_k_new: T | None = None, seqused_q: T | None = None,
        seqused_k: T | None = None, max_seqlen_q: int | None = None,
        max_seqlen_k: int | None = None, page_table: T | None = None,
        kv_batch_idx: T | None = None, leftpad_k: T | None = None, rotary_cos: T | None = None,
        rotary_sin: T | None = None, seqlens_rotary: T | None = None,
        q_descale: T | None = None, k_descale: T | None = None, v_descale: T | None = None,
        softmax_scale: float | None = None, causal: bool = False, window_size_left: int = -1,
        window_size_right: int = -1, attention_chunk: int = 0, softcap: float = 0.0,
        rotary_interleaved: bool = True, scheduler_metadata: T | None = None,
        num_splits: int = 1, pack_gqa: bool | None = None, sm_margin: int = 0,
    ) -> tuple[T, T, T, T]:  # fmt: skip
        unused = {"k_new": k_new, "qv": qv, "out_": out_, "cu_seqlens_q": cu_seqlens_q,
                  "page_table": page_table, "q_descale": q_descale}  # fmt: skip
        window = (window_size_left, window_size_right)
        o, lse = _mha_fwd(q, k, v, softmax_scale, causal, window, softcap, unused)
        return o, lse, o.new_empty(0, dtype=torch.float32), o.new_empty(0, dtype=torch.float32)

    @_flash_attn_forward.register_fake
    def _(q, k, v, *args, **kwargs):  # type: ignore[no-untyped-def]
        return _flash_attn_forward._init_fn(q, k, v, *args, **kwargs)

    @torch.library.custom_op(f"{namespace}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
    def _flash_attn_backward(
        dout: T, q: T, k: T, v: T, out: T, softmax_lse: T, cu_seqlens_q: T | None = None,
        cu_seqlens_k: T | None = None, sequed_q: T | None = None, sequed_k: T | None = None,
        max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, dq: T | None = None,
        dk: T | None = None, dv: T | None = None, softmax_scale: float | None = None,
        is_causal: bool = False, window_size_left: int = -1, window_size_right: int = -1,
        softcap: float = 0.0, deterministic: bool = False, sm_margin: int = 0,
    ) -> T:  # fmt: skip
        assert dq is not None and dk is not None and dv is not None, "we always pass buffers"
        dout, q, k, v, out = (maybe_contiguous(x) for x in (dout, q, k, v, out))
        unused = {"cu_seqlens_q": cu_seqlens_q, "sequed_q": sequed_q, "max_seqlen_k": max_seqlen_k}
        return _mha_bwd(
            "3.0.0", dout, q, k, v, out, softmax_lse, dq, dk, dv, unused, softmax_scale,
            is_causal, (window_size_left, window_size_right), softcap, deterministic,
        )  # fmt: skip

    @_flash_attn_backward.register_fake
    def _(*args, **kwargs):  # type: ignore[no-untyped-def]
        return _flash_attn_backward._init_fn(*args, **kwargs)

    _OPS["3.0.0"] = (_flash_attn_forward, _flash_attn_backward)
    return _OPS["3.0.0"]


_FUNCTIONS = {
    "v2.7.4.post1": _functions_v2_7_4,
    "v2.8.3": _functions_v2_8_3,
    "3.0.0": _custom_ops,
    "v2.7.0": _functions_v2_7_0,
}


def install_flash_attn3(monkeypatch: pytest.MonkeyPatch, interface: str = "3.0.0") -> None:
    """Put the stand-in ``flash_attn_interface`` of ``interface`` (a key of ``_FUNCTIONS``) in
    ``sys.modules``, its ``flash_attn_3`` distribution seen as upstream installs it;
    :data:`CALLS` starts empty."""
    CALLS.clear()
    module = types.ModuleType("flash_attn_interface")
    forward, backward = _FUNCTIONS[interface]()
    module._flash_attn_forward = forward  # type: ignore[attr-defined]
    module._flash_attn_backward = backward  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn_interface", module)
    fake_distributions(monkeypatch, {"flash_attn_3": _DISTRIBUTION[interface]})
