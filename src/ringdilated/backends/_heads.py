"""Grouped-query heads for kernels that need equal query and key/value head counts."""

from __future__ import annotations

import torch

__all__ = ["repeat_kv", "sum_kv"]


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(N, Hkv, L, D)`` to ``(N, num_heads, L, D)``: key/value head ``g`` serves query heads
    ``g * r .. g * r + r - 1`` with ``r = num_heads // Hkv`` (the kernel contract's grouping)."""
    repeat = num_heads // x.shape[1]
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=1)


def sum_kv(grad: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The adjoint of :func:`repeat_kv`: sum the gradients of each group's repeated heads."""
    n, h, length, d = grad.shape
    if h == num_kv_heads:
        return grad
    return grad.view(n, num_kv_heads, h // num_kv_heads, length, d).sum(2)
