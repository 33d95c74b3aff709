"""A stand-in ``flash_attn`` package for each supported version, run on CPU in float64.

Signatures and return tuples are those of the released sources (``flash_attn_interface.py`` of
2.6.3, 2.7.4.post1 and 2.8.3); the checks are ``flash_api.cpp``'s ``TORCH_CHECK``s (half dtypes,
matching dtypes, contiguous last dimension, head sizes, shapes). ``softmax_lse`` is read the way
the backward kernel reads it: a dense float32 ``(b, h, seqlen_q)`` array from its data pointer,
whatever its strides or dtype, so a strided or float64 lse gives wrong gradients here exactly as
on a GPU. Gradients are written into the ``dq``, ``dk``, ``dv`` given, through their strides.
From 2.7 the backward is a ``torch.library`` custom op (schema-checked arguments, keyword names
from the schema), as upstream registers it.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.standins.math import attend, bottom_right, grads
from tests.standins.memory import read_as

__all__ = ["VERSIONS", "install_flash_attn"]

VERSIONS = ("2.6.3", "2.7.4.post1", "2.8.3")
_HALF = (torch.float16, torch.bfloat16)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(message)  # TORCH_CHECK raises RuntimeError


def maybe_contiguous(x: torch.Tensor | None) -> torch.Tensor | None:
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    _check(q.dtype in _HALF, "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype")
    for x in (q, k, v):
        _check(x.stride(-1) == 1, "Input tensor must have contiguous last dimension")
    b, _, h, d = q.shape
    _check(b > 0, "batch size must be positive")
    _check(d <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(k.dim() == 4 and k.shape[0] == b and k.shape[3] == d, "key shape")
    _check(v.shape == k.shape, "value shape")
    _check(h % k.shape[2] == 0, "Number of heads in key/value must divide number of heads in query")


def _forward(q, k, v, softmax_scale, causal):  # type: ignore[no-untyped-def]
    _check_qkv(q, k, v)
    visible = bottom_right(q.shape[1], k.shape[1]) if causal else None
    out, lse = attend(q, k, v, softmax_scale, visible)
    return out.to(q.dtype).contiguous(), lse.masked_fill(torch.isneginf(lse), float("inf")).float()


def _backward_into(  # type: ignore[no-untyped-def]
    dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window, softcap
) -> torch.Tensor:
    assert dropout_p == 0.0 and window == (-1, -1) and softcap == 0.0, "not what we call"
    dout, q, k, v, out = (maybe_contiguous(x) for x in (dout, q, k, v, out))
    _check_qkv(q, k, v)
    _check(out.dtype == q.dtype and dout.dtype == q.dtype, "out and dout must have q's dtype")
    b, sq, h, d = q.shape
    sk = k.shape[1]
    _check(d % 8 == 0, "head_size should be a multiple of 8")
    _check(out.shape == q.shape and dout.shape == q.shape, "out/dout shape")
    for g, like in ((dq, q), (dk, k), (dv, v)):
        _check(g.dtype == q.dtype, "dq, dk, dv must have q's dtype")
        _check(g.stride(-1) == 1, "dq, dk, dv must have contiguous last dimension")
        _check(g.shape == like.shape, "dq, dk, dv shape")
    # flash_bwd_kernel.h: lse is read at (bidb * h + bidh) * seqlen_q + row, as float32.
    lse = read_as(softmax_lse, (b, h, sq), (h * sq, sq, 1), torch.float32)
    visible = bottom_right(sq, sk) if causal else None
    for buffer, grad in zip((dq, dk, dv), grads(dout, q, k, v, out, lse, softmax_scale, visible)):  # noqa: B905
        buffer.copy_(grad)
    return torch.zeros(b, h, -(-sq // 128) * 128)


def _flash_attn_func(version: str) -> Callable[..., Any]:
    def flash_attn_func(
        q,
        k,
        v,
        dropout_p=0.0,
        softmax_scale=None,
        causal=False,
        window_size=(-1, -1),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        return_attn_probs=False,
    ):  # type: ignore[no-untyped-def]
        assert dropout_p == 0.0 and window_size == (-1, -1) and softcap == 0.0
        assert alibi_slopes is None
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** -0.5
        q, k, v = (maybe_contiguous(x) for x in (q, k, v))
        out, lse = _forward(q, k, v, softmax_scale, causal)
        if not return_attn_probs:
            return out
        # 2.6.3 leaves S_dmask undefined without dropout (None); 2.7+ returns an empty tensor.
        s_dmask = None if version.startswith("2.6") else torch.empty(0)
        return out, lse, s_dmask

    return flash_attn_func


def _backward_2_6():  # type: ignore[no-untyped-def]
    def _flash_attn_backward(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):  # type: ignore[no-untyped-def]
        softmax_d = _backward_into(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
            tuple(window_size), softcap,
        )  # fmt: skip
        return dq, dk, dv, softmax_d

    return _flash_attn_backward


_OPS: dict[str, Any] = {}


def _backward_custom_op(version: str) -> Any:
    """2.7+: ``flash_attn::_flash_attn_backward``, a custom op mutating dq, dk, dv; registered
    once per version under a stand-in namespace (the real one would clash across versions)."""
    if version in _OPS:
        return _OPS[version]
    namespace = "flash_attn_standin_" + version.replace(".", "_")

    @torch.library.custom_op(f"{namespace}::_flash_attn_backward", mutates_args=("dq", "dk", "dv"))
    def _flash_attn_backward(
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        softmax_lse: torch.Tensor,
        dq: torch.Tensor | None,
        dk: torch.Tensor | None,
        dv: torch.Tensor | None,
        dropout_p: float,
        softmax_scale: float,
        causal: bool,
        window_size_left: int,
        window_size_right: int,
        softcap: float,
        alibi_slopes: torch.Tensor | None,
        deterministic: bool,
        rng_state: torch.Tensor | None = None,
    ) -> torch.Tensor:
        assert dq is not None and dk is not None and dv is not None, "we always pass buffers"
        return _backward_into(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
            (window_size_left, window_size_right), softcap,
        )  # fmt: skip

    _OPS[version] = _flash_attn_backward
    return _flash_attn_backward


def install_flash_attn(monkeypatch: pytest.MonkeyPatch, version: str = "2.8.3") -> None:
    """Put the stand-in ``flash_attn`` of ``version`` (or an older, unsupported one) in
    ``sys.modules``."""
    package = types.ModuleType("flash_attn")
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    package.__version__ = version  # type: ignore[attr-defined]
    package.flash_attn_func = _flash_attn_func(version)  # type: ignore[attr-defined]
    interface.flash_attn_func = package.flash_attn_func  # type: ignore[attr-defined]
    interface._flash_attn_backward = (  # type: ignore[attr-defined]
        _backward_2_6() if version.startswith(("2.6", "2.5")) else _backward_custom_op(version)
    )
    package.flash_attn_interface = interface  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)
