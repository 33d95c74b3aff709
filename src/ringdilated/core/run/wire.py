"""The wire format of a sharded call: how a :class:`~ringdilated.core.plan.shards.Payload` of keys
and values (or of their gradients) is packed into one flat tensor, unpacked, and added back.

One flat tensor per (sender, receiver) and step: for each key/value head of the payload, in
order, that head's keys at the payload's positions, then its values; each ``(B, n_h, D)``. The
gradients sent back use the same layout. Both ends derive sizes and order from the same shard
plan, so nothing about the layout is sent. Index tensors are built once per payload and device.

Kernel-layout views of a rank's own tensors (its piece of a crossing segment) live here too:
:func:`piece` (keys and values), :func:`queries` and :func:`query_lse` (the query side).
"""

from __future__ import annotations

import functools
import math

import torch

from ringdilated.core.plan.shards import Crossing, Payload

__all__ = [
    "crossing_kv",
    "extract",
    "gradient_buffers",
    "kv_heads",
    "numel",
    "pack",
    "piece",
    "q_heads",
    "queries",
    "query_lse",
    "scatter_add",
    "scatter_add_returned",
    "unpack",
]


def q_heads(crossing: Crossing) -> slice:
    return slice(crossing.block.heads.q_start, crossing.block.heads.q_stop)


def kv_heads(crossing: Crossing) -> slice:
    return slice(crossing.block.heads.kv_start, crossing.block.heads.kv_stop)


def piece(x: torch.Tensor, crossing: Crossing, rank: int, heads: slice) -> torch.Tensor:
    """``(B, heads, count, D)`` kernel-layout view of ``rank``'s piece of a local tensor."""
    own = crossing.piece(rank)
    assert own is not None
    return own.selection.view(x)[:, 0, :, heads].transpose(1, 2)


def queries(
    x: torch.Tensor, crossing: Crossing, rank: int, heads: slice, origin: int
) -> torch.Tensor:
    """``(B, heads, count, D)`` kernel-layout view of the query rows of ``rank``'s piece
    (:meth:`~ringdilated.core.plan.shards.Crossing.query_rows`) in a local query-side tensor
    (``q``, ``out``, their gradients) whose first row is shard position ``origin`` (a query
    suffix's; ``0``: the whole shard)."""
    rows = crossing.query_selection(rank)
    return rows.view(x, origin=origin)[:, 0, :, heads].transpose(1, 2)


def query_lse(lse: torch.Tensor, crossing: Crossing, rank: int, origin: int) -> torch.Tensor:
    """``(B, heads, count)`` view of the query rows of ``rank``'s piece in a local ``(B, H, Lq)``
    lse (or its gradient) whose first row is shard position ``origin`` (see :func:`queries`)."""
    rows = crossing.query_selection(rank)
    return rows.view(lse, dim=2, origin=origin)[:, q_heads(crossing), 0]


def numel(payload: Payload, batch: int, head_dim: int) -> int:
    """Elements of the flat tensor: keys and values of every position of the payload."""
    return payload.elements(batch, head_dim)


@functools.lru_cache(maxsize=4096)
def _positions(payload: Payload, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per head of the payload, its positions (local to the sender) as an index tensor."""
    return tuple(torch.tensor(p, dtype=torch.long, device=device) for p in payload.positions)


@functools.lru_cache(maxsize=4096)
def _crossing_heads(
    payload: Payload, i: int, device: torch.device
) -> tuple[tuple[int, torch.Tensor], ...]:
    """Per key/value head of crossing ``i``: which unpacked payload tensor holds its keys (its
    values are the next one), and where its piece's positions sit in it, as an index tensor."""
    heads = payload.crossings[i].block.heads
    slot = {h: 2 * j for j, h in enumerate(payload.heads)}
    return tuple(
        (slot[h], torch.tensor(ix, dtype=torch.long, device=device))
        for h, ix in zip(range(heads.kv_start, heads.kv_stop), payload.index[i], strict=True)
    )


def pack(payload: Payload, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The flat tensor of ``payload`` from a sender's local ``(B, S, H, D)`` keys and values."""
    parts = []
    for h, index in zip(payload.heads, _positions(payload, k.device), strict=True):
        parts += [k[:, index, h].reshape(-1), v[:, index, h].reshape(-1)]
    return torch.cat(parts)


def unpack(flat: torch.Tensor, payload: Payload, batch: int, head_dim: int) -> list[torch.Tensor]:
    """Per head ``h`` of the payload: its keys then its values, each ``(B, n_h, D)`` (views)."""
    shapes = [(batch, len(pos), head_dim) for pos in payload.positions for _ in range(2)]
    parts = torch.split(flat, [math.prod(shape) for shape in shapes])
    return [part.view(shape) for part, shape in zip(parts, shapes, strict=True)]


@functools.lru_cache(maxsize=4096)
def _within(whole: Payload, part: Payload, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Per head of ``part``, where its positions sit among ``whole``'s positions of that head."""
    slots = {
        h: {p: i for i, p in enumerate(pos)}
        for h, pos in zip(whole.heads, whole.positions, strict=True)
    }
    return tuple(
        torch.tensor([slots[h][p] for p in pos], dtype=torch.long, device=device)
        for h, pos in zip(part.heads, part.positions, strict=True)
    )


def extract(
    flat: torch.Tensor, whole: Payload, part: Payload, batch: int, head_dim: int
) -> torch.Tensor:
    """The flat tensor of ``part`` from that of ``whole`` (a sender's broadcast payload, which
    holds every position of ``part``; trailing padding of ``flat`` is ignored)."""
    tensors = unpack(flat[: numel(whole, batch, head_dim)], whole, batch, head_dim)
    slot = {h: 2 * j for j, h in enumerate(whole.heads)}
    parts = []
    for h, index in zip(part.heads, _within(whole, part, flat.device), strict=True):
        parts += [tensors[slot[h] + kv][:, index].reshape(-1) for kv in (0, 1)]
    return torch.cat(parts)


def crossing_kv(
    payload: Payload, i: int, tensors: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Crossing ``i``'s keys and values in kernel layout ``(B, heads, n, D)`` from unpacked
    payload tensors."""
    heads = _crossing_heads(payload, i, tensors[0].device)
    k, v = (
        torch.stack([tensors[slot + kv][:, index] for slot, index in heads], 1) for kv in (0, 1)
    )
    return k, v


def gradient_buffers(
    payload: Payload, batch: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """Zeroed per-head ``(B, n_h, D)`` key and value gradients in the payload's layout."""
    return [
        torch.zeros(batch, len(pos), head_dim, dtype=dtype, device=device)
        for pos in payload.positions
        for _ in range(2)
    ]


def scatter_add(
    buffers: list[torch.Tensor], payload: Payload, i: int, dk: torch.Tensor, dv: torch.Tensor
) -> None:
    """Add crossing ``i``'s kernel-layout ``dk``, ``dv`` ``(B, heads, n, D)`` into ``buffers``
    (from :func:`gradient_buffers`) at its piece's positions."""
    for j, (slot, index) in enumerate(_crossing_heads(payload, i, dk.device)):
        buffers[slot].index_add_(1, index, dk[:, j].to(buffers[0].dtype))
        buffers[slot + 1].index_add_(1, index, dv[:, j].to(buffers[0].dtype))


def scatter_add_returned(
    dk: torch.Tensor, dv: torch.Tensor, payload: Payload, returned: list[torch.Tensor]
) -> None:
    """Add gradients sent back for ``payload`` (unpacked) into a sender's local ``(B, S, H, D)``
    ``dk``, ``dv`` at the payload's positions."""
    for j, (h, index) in enumerate(zip(payload.heads, _positions(payload, dk.device), strict=True)):
        dk[:, :, h].index_add_(1, index, returned[2 * j].to(dk.dtype))
        dv[:, :, h].index_add_(1, index, returned[2 * j + 1].to(dv.dtype))
