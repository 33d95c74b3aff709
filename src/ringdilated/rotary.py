"""Rotary position embeddings (RoPE) for the modules' ``rotary=`` argument.

A rotary callable takes ``x`` ``(B, L, heads, D)`` and ``positions`` ``(B or 1, L)`` (int64) and
returns ``x`` rotated. ``MultiheadDilatedAttention(rotary=...)`` applies it to ``q`` and ``k``
after the projections and before the attention, with each position counted from the start of its
document (packed documents and padded rows restart at 0, as Hugging Face's ``position_ids`` do;
padded positions get 0) and, while decoding with a cache, from the cache's length.
:func:`rotary_embedding` is the usual one (Llama's half-split layout); pass your own for
another layout or scaling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["Rotary", "rotary_embedding"]

Rotary = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(x (B, L, heads, D), positions (B or 1, L)) -> x rotated``."""


def rotary_embedding(
    x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0
) -> torch.Tensor:
    """``x`` rotated by RoPE in the half-split layout: dimension ``i < D/2`` pairs with
    ``i + D/2`` and turns by ``position * base ** (-2 i / D)``. Computed in float32 (float64 for
    float64 inputs) and returned in ``x``'s dtype; ``D`` must be even."""
    dim = x.shape[-1]
    if dim % 2:
        raise ValueError(f"rotary_embedding needs an even head dim, got {dim}")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    inverse = base ** (-torch.arange(0, dim, 2, device=x.device, dtype=work) / dim)
    angles = positions.to(work).unsqueeze(-1) * inverse  # (B, L, D/2)
    cos, sin = (torch.cat([f(angles)] * 2, -1).unsqueeze(2) for f in (torch.cos, torch.sin))
    first, second = x.to(work).chunk(2, -1)
    turned = torch.cat([-second, first], -1)
    return (x.to(work) * cos + turned * sin).to(x.dtype)
