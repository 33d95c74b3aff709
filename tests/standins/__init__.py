"""Stand-ins for optional GPU packages, with their documented semantics in plain float64 math.

They let the real ``flash``, ``xformers`` and ``flex`` kernel wrappers run on CPU: layouts,
grouped-query heads, bottom-right causal masks, lse conventions (flash-attn gives ``+inf`` for a
row with no key; xformers pads its lse to 32 rows) and backward buffers are the packages'; only
the speed is not. :func:`install` puts them in ``sys.modules``.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
import torch

__all__ = ["install_flash_attn", "install_xformers", "math_flex_attention"]


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, visible: torch.Tensor | None) -> Any:
    """``(B, H, Lq, Lk)`` float64 scores from ``(B, L, H, D)`` inputs, grouped heads expanded."""
    group = q.shape[2] // k.shape[2]
    qd = q.double().transpose(1, 2)
    kd = k.double().transpose(1, 2).repeat_interleave(group, 1)
    s = qd @ kd.transpose(-1, -2) * scale
    return s if visible is None else s.masked_fill(~visible, float("-inf"))


def _bottom_right(q_len: int, k_len: int) -> torch.Tensor:
    rows = torch.arange(q_len).unsqueeze(1)
    return torch.arange(k_len).unsqueeze(0) <= rows + (k_len - q_len)


def _attend(q, k, v, scale, visible, empty_lse):  # type: ignore[no-untyped-def]
    s = _scores(q, k, scale, visible)
    lse = torch.logsumexp(s, -1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - lse.masked_fill(empty, 0).unsqueeze(-1))
    group = q.shape[2] // v.shape[2]
    out = p @ v.double().transpose(1, 2).repeat_interleave(group, 1)
    return out.transpose(1, 2).to(q.dtype), lse.masked_fill(empty, empty_lse).float()


def _grads(dout, q, k, v, out, lse, scale, visible):  # type: ignore[no-untyped-def]
    """Attention backward given ``out`` and ``lse``: the flash/xformers formula, in float64."""
    group = q.shape[2] // k.shape[2]
    s = _scores(q, k, scale, visible)
    p = torch.exp(s - lse.double().unsqueeze(-1))
    do = dout.double().transpose(1, 2)
    vd = v.double().transpose(1, 2).repeat_interleave(group, 1)
    kd = k.double().transpose(1, 2).repeat_interleave(group, 1)
    d = (do * out.double().transpose(1, 2)).sum(-1, keepdim=True)
    ds = p * (do @ vd.transpose(-1, -2) - d)
    dq = ds @ kd * scale
    dk = ds.transpose(-1, -2) @ q.double().transpose(1, 2) * scale
    dv = p.transpose(-1, -2) @ do

    def fold(x: torch.Tensor) -> torch.Tensor:
        b, h, n, e = x.shape
        return x.view(b, h // group, group, n, e).sum(2).transpose(1, 2)

    return dq.transpose(1, 2), fold(dk), fold(dv)


def _require_stride(*xs: torch.Tensor) -> None:
    for x in xs:
        assert x.stride(-1) == 1, "last dimension must be contiguous"


def install_flash_attn(monkeypatch: pytest.MonkeyPatch, version: str = "2.6.3") -> None:
    """``flash_attn`` with ``flash_attn_func`` and ``flash_attn_interface._flash_attn_backward``."""

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kw):  # type: ignore[no-untyped-def]
        assert dropout_p == 0.0 and kw.get("return_attn_probs")
        _require_stride(q, k, v)
        visible = _bottom_right(q.shape[1], k.shape[1]) if causal else None
        out, lse = _attend(q, k, v, softmax_scale, visible, float("inf"))
        return out, lse, torch.empty(0)

    def _flash_attn_backward(  # type: ignore[no-untyped-def]
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
        window_size_left,
        window_size_right,
        softcap,
        alibi_slopes,
        deterministic,
        rng_state=None,
    ):
        assert (window_size_left, window_size_right, softcap, dropout_p) == (-1, -1, 0.0, 0.0)
        assert softmax_lse.dtype == torch.float32 and softmax_lse.is_contiguous()
        _require_stride(dout, q, k, v, out)
        visible = _bottom_right(q.shape[1], k.shape[1]) if causal else None
        for buffer, grad in zip(  # noqa: B905
            (dq, dk, dv), _grads(dout, q, k, v, out, softmax_lse, softmax_scale, visible)
        ):
            buffer.copy_(grad)
        return torch.empty(0)

    package = types.ModuleType("flash_attn")
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    package.__version__ = version  # type: ignore[attr-defined]
    package.flash_attn_func = flash_attn_func  # type: ignore[attr-defined]
    interface._flash_attn_backward = _flash_attn_backward  # type: ignore[attr-defined]
    package.flash_attn_interface = interface  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", package)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", interface)


def install_xformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """``xformers.ops.fmha`` with the two functions the wrapper calls and the CUTLASS op names."""

    class LowerTriangularFromBottomRightMask:
        pass

    class FwOp:
        pass

    class BwOp:
        pass

    def check(q, k, v, attn_bias, op, expected):  # type: ignore[no-untyped-def]
        assert op is expected, "the wrapper forces the CUTLASS operators"
        assert q.shape[2] == k.shape[2] == v.shape[2], "BMHK takes equal head counts"
        _require_stride(q, k, v)
        if attn_bias is None:
            return None
        assert isinstance(attn_bias, LowerTriangularFromBottomRightMask)
        return _bottom_right(q.shape[1], k.shape[1])

    def forward_requires_grad(q, k, v, attn_bias=None, p=0.0, scale=None, *, op=None):  # type: ignore[no-untyped-def]
        visible = check(q, k, v, attn_bias, op, FwOp)
        out, lse = _attend(q, k, v, scale, visible, float("inf"))
        padded = torch.full((*lse.shape[:-1], -(-lse.shape[-1] // 32) * 32), 7.0)
        padded[..., : lse.shape[-1]] = lse
        return out, padded

    def backward(grad, output, lse, q, k, v, attn_bias=None, p=0.0, scale=None, *, op=None):  # type: ignore[no-untyped-def]
        visible = check(q, k, v, attn_bias, op, BwOp)
        assert lse.shape[-1] >= q.shape[1]
        grads = _grads(grad, q, k, v, output, lse[..., : q.shape[1]], scale, visible)
        return tuple(g.to(q.dtype) for g in grads)

    fmha = types.ModuleType("xformers.ops.fmha")
    cutlass = types.ModuleType("xformers.ops.fmha.cutlass")
    attn_bias = types.ModuleType("xformers.ops.fmha.attn_bias")
    attn_bias.LowerTriangularFromBottomRightMask = LowerTriangularFromBottomRightMask  # type: ignore[attr-defined]
    cutlass.FwOp, cutlass.BwOp = FwOp, BwOp  # type: ignore[attr-defined]
    fmha.attn_bias, fmha.cutlass = attn_bias, cutlass  # type: ignore[attr-defined]
    fmha.memory_efficient_attention_forward_requires_grad = forward_requires_grad  # type: ignore[attr-defined]
    fmha.memory_efficient_attention_backward = backward  # type: ignore[attr-defined]
    ops = types.ModuleType("xformers.ops")
    ops.fmha = fmha  # type: ignore[attr-defined]
    root = types.ModuleType("xformers")
    root.ops = ops  # type: ignore[attr-defined]
    for name, module in (
        ("xformers", root),
        ("xformers.ops", ops),
        ("xformers.ops.fmha", fmha),
        ("xformers.ops.fmha.cutlass", cutlass),
        ("xformers.ops.fmha.attn_bias", attn_bias),
    ):
        monkeypatch.setitem(sys.modules, name, module)


def math_flex_attention(q, k, v, block_mask=None, scale=None, enable_gqa=False, return_aux=None):  # type: ignore[no-untyped-def]
    """``flex_attention``'s signature and semantics in differentiable math (CPU has no flex
    backward); kernel layout ``(B, H, L, D)``; the mask_mod is evaluated densely."""
    assert return_aux.lse and enable_gqa == (q.shape[1] != k.shape[1])
    group = q.shape[1] // k.shape[1]
    kd, vd = (x.double().repeat_interleave(group, 1) for x in (k, v))
    s = q.double() @ kd.transpose(-1, -2) * scale
    if block_mask is not None:
        rows = torch.arange(q.shape[-2]).view(-1, 1)
        cols = torch.arange(k.shape[-2]).view(1, -1)
        s = s.masked_fill(~block_mask.mask_mod(None, None, rows, cols), float("-inf"))
    empty = torch.isneginf(s).all(-1, keepdim=True)
    lse = torch.logsumexp(s.masked_fill(empty, 0.0), -1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ vd
    lse = lse.masked_fill(empty.squeeze(-1), float("-inf")).float()
    return out.to(q.dtype), types.SimpleNamespace(lse=lse)
