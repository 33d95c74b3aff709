"""Attention in float64 for the stand-ins, in the ``(B, L, H, D)`` layout the packages use.

``softcap`` (FlashAttention's ``softcap``, docs/spec.md section 5): every score ``s = scale * q .
k`` becomes ``softcap * tanh(s / softcap)`` before the mask, the bias and the softmax; the
backward multiplies ``dS`` by ``1 - tanh(s / softcap) ** 2`` (flash-attn's ``Is_softcap`` path).
"""

from __future__ import annotations

import torch

__all__ = ["attend", "bottom_right", "bottom_right_window", "grads", "top_left"]


def bottom_right(q_len: int, k_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """flash-attn's and xformers' causal mask: key ``j`` visible iff ``j <= i + k_len - q_len``."""
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    return torch.arange(k_len, device=device).unsqueeze(0) <= rows + (k_len - q_len)


def bottom_right_window(
    q_len: int, k_len: int, left: int | None, right: int | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The flash kernels' local mask once their arguments are resolved: key ``j`` visible to row
    ``i`` iff ``i + shift - left <= j <= i + shift + right``, ``shift = k_len - q_len`` (``None``:
    unbounded on that side; flash-attn's ``mask.h`` ``apply_mask_local``)."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (k_len - q_len)
    cols = torch.arange(k_len, device=device).unsqueeze(0)
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if right is not None:
        visible &= cols <= rows + right
    if left is not None:
        visible &= cols >= rows - left
    return visible


def top_left(q_len: int, k_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The memory-efficient kernel's ``is_causal``: key ``j`` visible iff ``j <= i``."""
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    return torch.arange(k_len, device=device).unsqueeze(0) <= rows


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``(B, L, Hkv, D)`` to float64 ``(B, heads, L, D)``, grouped heads repeated."""
    return x.double().transpose(1, 2).repeat_interleave(heads // x.shape[2], 1)


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """``(B, H, Lq, Lk)`` float64 scores, capped by ``softcap``; ``bias`` ``(B, H, Lq, Lk)`` is
    added."""
    s = q.double().transpose(1, 2) @ _expand(k, q.shape[2]).transpose(-1, -2) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s + bias.double()
    return s if visible is None else s.masked_fill(~visible, float("-inf"))


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    drop: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, Lq, H, D) float64, lse (B, H, Lq) float64)``; ``lse = -inf`` on empty rows.
    ``drop`` ``(B, H, Lq, Lk)`` multiplies the probabilities (dropout: 0 or ``1 / (1 - p)``);
    the lse is that of the undropped scores, as the fused kernels report it."""
    s = scores(q, k, scale, visible, bias, softcap)
    lse = torch.logsumexp(s, -1)
    empty = torch.isneginf(lse)
    p = torch.exp(s - lse.masked_fill(empty, 0).unsqueeze(-1))
    if drop is not None:
        p = p * drop
    out = p @ _expand(v, q.shape[2])
    return out.transpose(1, 2), lse


def grads(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    visible: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    drop: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused kernels' backward given ``out`` and ``lse`` (``P = exp(s - lse)``,
    ``D = rowsum(dout * out)``), float64, ``(B, L, H, D)`` layout, grouped heads summed (``dk``
    over ``k``'s groups, ``dv`` over ``v``'s, which may differ). ``drop`` is the forward's
    dropout multiplier (as in :func:`attend`); ``dlse`` ``(B, H, Lq)``, the lse's gradient, is
    folded in as FlashAttention 4's preprocess does: ``D - dlse`` in place of ``D``."""
    heads = q.shape[2]
    s = scores(q, k, scale, visible, bias, softcap)
    p = torch.exp(s - lse.double().unsqueeze(-1))
    do = dout.double().transpose(1, 2)
    d = (do * out.double().transpose(1, 2)).sum(-1, keepdim=True)
    if dlse is not None:
        d = d - dlse.double().unsqueeze(-1)
    dp = do @ _expand(v, heads).transpose(-1, -2)
    kept = p if drop is None else p * drop
    if drop is not None:
        dp = dp * drop
    ds = p * (dp - d)
    if softcap:  # d(c * tanh(x / c)) / dx
        raw = q.double().transpose(1, 2) @ _expand(k, heads).transpose(-1, -2) * scale
        ds = ds * (1 - torch.tanh(raw / softcap) ** 2)
    dq = ds @ _expand(k, heads) * scale
    dk = ds.transpose(-1, -2) @ q.double().transpose(1, 2) * scale
    dv = kept.transpose(-1, -2) @ do

    def fold(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
        b, h, n, e = x.shape
        return x.view(b, kv_heads, h // kv_heads, n, e).sum(2).transpose(1, 2)

    return dq.transpose(1, 2), fold(dk, k.shape[2]), fold(dv, v.shape[2])
