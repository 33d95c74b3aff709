"""``flex_attention`` in differentiable float64 math, with its 2.13 signature (CPU FlexAttention
has no backward): kernel layout ``(B, H, L, D)``, the ``mask_mod`` evaluated densely, ``lse``
through ``return_aux`` (float32; float64 for float64 inputs, as torch 2.13 returns it), ``-inf``
and zeros on rows with no visible key."""

from __future__ import annotations

import types

import torch

__all__ = ["math_flex_attention"]


def math_flex_attention(
    query,
    key,
    value,
    score_mod=None,
    block_mask=None,
    scale=None,
    enable_gqa=False,
    return_lse=False,
    kernel_options=None,
    *,
    return_aux=None,
):  # type: ignore[no-untyped-def]
    assert score_mod is None and not return_lse and return_aux.lse
    assert enable_gqa == (query.shape[1] != key.shape[1]), "enable_gqa must match the heads"
    assert query.shape[-2] == (query.shape[-2] if block_mask is None else block_mask.shape[-2])
    group = query.shape[1] // key.shape[1]
    kd, vd = (x.double().repeat_interleave(group, 1) for x in (key, value))
    s = query.double() @ kd.transpose(-1, -2) * scale
    if block_mask is not None:
        rows = torch.arange(query.shape[-2]).view(-1, 1)
        cols = torch.arange(key.shape[-2]).view(1, -1)
        s = s.masked_fill(~block_mask.mask_mod(None, None, rows, cols), float("-inf"))
    empty = torch.isneginf(s).all(-1, keepdim=True)
    lse = torch.logsumexp(s.masked_fill(empty, 0.0), -1)
    out = torch.exp(s - lse.unsqueeze(-1)) @ vd
    out = out.masked_fill(empty, 0.0)
    lse_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    lse = lse.masked_fill(empty.squeeze(-1), float("-inf")).to(lse_dtype)
    return out.to(query.dtype), types.SimpleNamespace(lse=lse)
