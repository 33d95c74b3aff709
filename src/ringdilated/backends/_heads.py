"""Grouped-query heads for kernels whose ops take equal query and key/value head counts.

The kernel contract groups heads: key/value head ``g`` serves query heads ``g * r .. g * r + r -
1`` with ``r = heads // kv_heads``. An op that reads its key and value through their strides (the
memory-efficient kernels: ``key_ptr + head_id * k_strideH``) takes a key/value head *expanded*
to ``r`` heads with stride 0: one head's memory read ``r`` times, nothing copied.
:func:`kv_groups` lays a call out that way, one op call per key/value head (a single call when
there is only one, or when the counts are already equal); :func:`join_heads` puts the calls'
results back together, and :func:`sum_kv` reduces the per-query-head key/value gradients such
an op returns to the key/value heads (a reduction, not a copy of the inputs).

:func:`repeat_kv` materialises the repetition; only the dense kernels, which compute with plain
matmuls, use it.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

__all__ = ["HeadGroup", "expand_kv", "join_heads", "kv_groups", "repeat_kv", "sum_kv"]


def repeat_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(N, Hkv, L, D)`` to ``(N, num_heads, L, D)``: key/value head ``g`` serves query heads
    ``g * r .. g * r + r - 1`` with ``r = num_heads // Hkv`` (the kernel contract's grouping).
    A copy (unless ``r == 1``)."""
    repeat = num_heads // x.shape[1]
    return x if repeat == 1 else x.repeat_interleave(repeat, dim=1)


def sum_kv(grad: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The adjoint of :func:`repeat_kv` and :func:`expand_kv`: ``(N, H, L, D)`` gradients of
    each group's ``H // num_kv_heads`` heads summed, ``(N, num_kv_heads, L, D)``."""
    n, h, length, d = grad.shape
    if h == num_kv_heads:
        return grad
    return grad.view(n, num_kv_heads, h // num_kv_heads, length, d).sum(2)


def expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """``(N, 1, L, D)`` as ``(N, num_heads, L, D)`` with stride 0 along heads: a view."""
    if x.shape[1] != 1:
        raise ValueError(f"expand_kv takes one key/value head, got {x.shape[1]}")
    return x.expand(-1, num_heads, -1, -1)


@attrs.frozen(eq=False)
class HeadGroup:
    """One op call of a grouped-heads call (:func:`kv_groups`): query heads ``first ..
    first + q.shape[1] - 1`` of the caller's, against its key/value heads ``index ..
    index + kv_heads - 1`` (expanded to the query heads when ``kv_heads`` is 1 and they differ).
    ``q``, ``k``, ``v`` are what the op gets, all views of the caller's tensors."""

    index: int
    first: int
    kv_heads: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor

    def query_heads(self, x: torch.Tensor) -> torch.Tensor:
        """This call's query heads of an ``(N, H, ...)`` tensor of the caller's (``dout``,
        ``out``, the lse): a narrowing."""
        return x.narrow(1, self.first, self.q.shape[1])

    def kv_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """The op's ``dk`` or ``dv`` (one per query head) reduced to this call's key/value heads."""
        return sum_kv(grad, self.kv_heads)


def kv_groups(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[HeadGroup, ...]:
    """The op calls that serve ``q (N, H, Lq, D)`` against ``k, v (N, Hkv, Lk, D)`` with equal
    head counts and nothing repeated:

    - ``H == Hkv``: one call, ``(q, k, v)`` as given;
    - otherwise one call per key/value head ``g``: query heads ``g * r .. g * r + r - 1`` (a
      narrowing) against key/value head ``g`` expanded to ``r`` heads (:func:`expand_kv`). One
      key/value head (multi-query) is one call.

    Raises ``ValueError`` when ``Hkv`` does not divide ``H``."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads or v.shape[1] != kv_heads:
        raise ValueError(
            f"key/value heads must divide query heads: q {heads}, k {kv_heads}, v {v.shape[1]}"
        )
    if heads == kv_heads:
        return (HeadGroup(0, 0, kv_heads, q, k, v),)
    r = heads // kv_heads
    return tuple(
        HeadGroup(
            g,
            g * r,
            1,
            q.narrow(1, g * r, r),
            expand_kv(k.narrow(1, g, 1), r),
            expand_kv(v.narrow(1, g, 1), r),
        )
        for g in range(kv_heads)
    )


def join_heads(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per-call results ``(N, h_i, ...)`` as one ``(N, sum h_i, ...)``: the single result itself,
    else their concatenation along heads."""
    return parts[0] if len(parts) == 1 else torch.cat(tuple(parts), 1)
