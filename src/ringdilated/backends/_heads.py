"""Grouped-query heads for kernels whose ops take equal query and key/value head counts.

The kernel contract groups heads: key/value head ``g`` serves query heads ``g * r .. g * r + r -
1`` with ``r = heads // kv_heads``. An op that reads its key and value through their strides (the
memory-efficient kernels: ``key_ptr + head_id * k_strideH``) takes a key/value head *expanded*
to ``r`` heads with stride 0: one head's memory read ``r`` times, nothing copied.
:func:`kv_groups` lays a call out that way, one op call per key/value head (a single call when
there is only one, or when the counts are already equal); :func:`join_heads` puts the calls'
results back together, and :func:`sum_kv` reduces the per-query-head key/value gradients such
an op returns to the key/value heads (a reduction, not a copy of the inputs).

One call per key/value head trades the copy of ``k`` and ``v`` for ``Hkv - 1`` more launches, each
with ``1 / Hkv`` of the grid. For a small call the launches cost more than the copy (a grid of a
few blocks leaves most of the GPU idle, and each launch costs host time), so :func:`kv_groups`
groups only calls whose every group fills :data:`GROUPED_MIN_TILES` query tiles, and repeats
``k``, ``v`` for the rest: one call, as before grouping. The threshold is an estimate (two waves
of 64-row tiles on a 132-SM H100), not a measurement.

:func:`repeat_kv` materialises the repetition; the dense kernels, which compute with plain
matmuls, use it, and :func:`kv_groups` for small calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

__all__ = [
    "GROUPED_MIN_TILES",
    "QUERY_TILE",
    "HeadGroup",
    "expand_kv",
    "join_heads",
    "kv_groups",
    "repeat_kv",
    "sum_kv",
]

#: Query rows per block of the memory-efficient kernels' forward grid (``kernel_forward.h``:
#: ``kQueriesPerBlock`` 64 for 16-bit inputs on sm80+, 32 otherwise: the larger is used).
QUERY_TILE = 64
#: A grouped call (one per key/value head) is made only when each group's grid holds at least
#: this many query tiles (``N * r * ceil(Lq / QUERY_TILE)``); below it ``k``, ``v`` are repeated.
GROUPED_MIN_TILES = 256


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
    index + kv_heads - 1`` (expanded to the query heads when ``kv_heads`` is 1 and they differ,
    else repeated to them). ``q``, ``k``, ``v`` are what the op gets: views of the caller's
    tensors, except repeated ``k``, ``v``."""

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
    head counts:

    - ``H == Hkv``: one call, ``(q, k, v)`` as given;
    - one key/value head (multi-query): one call, the head expanded to ``H`` (:func:`expand_kv`);
    - a grid of at least :data:`GROUPED_MIN_TILES` query tiles per group: one call per key/value
      head ``g``, query heads ``g * r .. g * r + r - 1`` (a narrowing) against key/value head
      ``g`` expanded to ``r`` heads, nothing repeated;
    - otherwise one call with ``k``, ``v`` repeated (:func:`repeat_kv`; module docstring).

    Raises ``ValueError`` when ``Hkv`` does not divide ``H``."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads or v.shape[1] != kv_heads:
        raise ValueError(
            f"key/value heads must divide query heads: q {heads}, k {kv_heads}, v {v.shape[1]}"
        )
    if heads == kv_heads:
        return (HeadGroup(0, 0, kv_heads, q, k, v),)
    r = heads // kv_heads
    tiles = q.shape[0] * r * -(-q.shape[2] // QUERY_TILE)
    if kv_heads > 1 and tiles < GROUPED_MIN_TILES:
        return (HeadGroup(0, 0, kv_heads, q, repeat_kv(k, heads), repeat_kv(v, heads)),)
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
