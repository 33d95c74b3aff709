"""Dense softmax attention for one block, exact for non-finite inputs, in bounded memory.

The ``reference`` kernel is this math, and every fused built-in kernel (sdpa on CPU and CUDA,
flash, xformers, flex) falls back to it when a call's inputs hold NaN or infinity
(:func:`~ringdilated.core.kernel.inputs_finite`): PyTorch's CPU flash kernel, for one, can return
zeros for a query row holding a NaN and can spread a NaN or infinite value to queries that never
see it (behaviour that depends on the input), and fused kernels in general multiply hidden
values by zero weights.

Semantics, for every query row (the kernel contract, :mod:`ringdilated.core.kernel`; docs/spec.md,
section 4): attention runs over the row's *visible* keys only. A hidden key takes no part,
whatever it holds: its score is replaced by ``-inf`` before the softmax, and its value is never
multiplied by the zero weight (``0 * NaN`` is NaN), so a NaN or infinite key or value reaches
exactly the queries that see it. A row with no visible key gives ``out = 0`` and ``lse = -inf``;
a row whose visible scores are all ``-inf`` (infinite inputs) gives what softmax gives, NaN,
with ``lse = -inf``.

Memory: scores are computed a tile of query rows at a time, at most ``TILE_ELEMENTS`` of them
when one query row of every problem fits (``N x H x Lk <= TILE_ELEMENTS``), else one row at a
time (the reference kernel no longer holds a whole ``Lq x Lk`` matrix per problem). Non-finite
values cost a matmul over the finite part plus a correction over the few keys that hold them.
"""

from __future__ import annotations

import torch

from ringdilated.backends._heads import repeat_kv, sum_kv
from ringdilated.core.accumulator import accumulation_dtype
from ringdilated.core.causal import BottomRightKernel
from ringdilated.core.kernel import BlockOptions, all_finite, inputs_finite

__all__ = [
    "TILE_ELEMENTS",
    "ExactBottomRightKernel",
    "all_finite",
    "backward",
    "forward",
    "visible_keys",
    "weighted_values",
]

#: Score elements (problems x heads x rows x keys) computed at once.
TILE_ELEMENTS = 1 << 24


def visible_keys(
    q_len: int, k_len: int, offset: int | None, device: torch.device
) -> torch.Tensor | None:
    """``(q_len, k_len)`` bool: key ``j`` visible to query ``i`` (``None``: every key)."""
    if offset is None:
        return None
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    return torch.arange(k_len, device=device) <= rows + offset


def weighted_values(
    p: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, v_finite: bool | None = None
) -> torch.Tensor:
    """``sum_j p_ij v_j`` over visible ``j`` only. ``p`` ``(N, H, Lq, Lk)``, ``v`` ``(N, H, Lk,
    D)``. A matmul when ``v`` is finite (``v_finite``, checked when ``None``); otherwise a matmul
    over ``v`` with its non-finite entries zeroed, plus, for each key holding one, its
    non-finite entries added to the queries that see it (so ``0 * inf`` never reaches a query
    that does not)."""
    if v_finite is None:
        v_finite = all_finite(v)
    if v_finite:
        return torch.matmul(p, v)
    bad = torch.isfinite(v).logical_not()
    out = torch.matmul(p, torch.where(bad, torch.zeros_like(v), v))
    n, h, key = bad.any(-1).nonzero(as_tuple=True)  # the keys holding a non-finite value
    step = max(1, TILE_ELEMENTS // max(1, p.shape[-2] * v.shape[-1]))
    for start in range(0, n.numel(), step):
        pn, ph, pk = n[start : start + step], h[start : start + step], key[start : start + step]
        weights = p[pn, ph, :, pk]  # (T, Lq)
        values = torch.where(bad[pn, ph, pk], v[pn, ph, pk], torch.zeros((), dtype=v.dtype))
        terms = weights.unsqueeze(-1) * values.unsqueeze(-2)  # (T, Lq, D)
        if visible is not None:
            seen = visible[:, pk].transpose(0, 1).unsqueeze(-1)  # (T, Lq, 1)
            terms = torch.where(seen, terms, torch.zeros((), dtype=terms.dtype))
        out.index_put_((pn, ph), terms, accumulate=True)
    return out


def _tiles(q: torch.Tensor, k_len: int) -> list[slice]:
    rows = max(1, TILE_ELEMENTS // max(1, q.shape[0] * q.shape[1] * k_len))
    return [slice(i, i + rows) for i in range(0, q.shape[-2], rows)]


def _scores(
    q: torch.Tensor, k: torch.Tensor, scale: float, visible: torch.Tensor | None
) -> torch.Tensor:
    dtype = accumulation_dtype(q.dtype)
    kd = repeat_kv(k, q.shape[1]).to(dtype)
    scores = torch.matmul(q.to(dtype), kd.transpose(-1, -2)) * scale
    if visible is not None:  # where, not an added mask: a NaN score of a hidden key goes too
        scores = torch.where(visible, scores, scores.new_full((), float("-inf")))
    return scores


def _probabilities(
    scores: torch.Tensor, lse: torch.Tensor, visible: torch.Tensor | None
) -> torch.Tensor:
    """``P = exp(s - lse)``; rows with no visible key (``lse = -inf``) give ``P = 0``, rows
    whose visible scores are all ``-inf`` give NaN, as softmax does."""
    lse = lse.to(scores.dtype)
    if visible is None:  # every row sees a key
        return torch.exp(scores - lse.unsqueeze(-1))
    empty = torch.isneginf(lse) & visible.any(-1).logical_not()
    finite = torch.where(empty, torch.zeros_like(lse), lse)
    return torch.exp(scores - finite.unsqueeze(-1))


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: BlockOptions,
    drop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the block; ``drop`` scales the probabilities (dropout, already divided
    by the keep probability), shaped like the scores."""
    visible = visible_keys(q.shape[-2], k.shape[-2], options.causal_offset, q.device)
    dtype = accumulation_dtype(q.dtype)
    values = repeat_kv(v, q.shape[1]).to(dtype)
    v_finite = options.finite if options.finite else all_finite(v)
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=dtype, device=q.device)
    for rows in _tiles(q, k.shape[-2]):
        seen = None if visible is None else visible[rows]
        scores = _scores(q[..., rows, :], k, options.scale, seen)
        lse[..., rows] = torch.logsumexp(scores, dim=-1)
        p = _probabilities(scores, lse[..., rows], seen)
        if drop is not None:
            p = p * drop[..., rows, :]
        out[..., rows, :] = weighted_values(p, values, seen, v_finite)
    return out.to(q.dtype), lse


def backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    options: BlockOptions,
    drop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` given the final ``out`` and ``lse`` (the kernel contract's rule)."""
    visible = visible_keys(q.shape[-2], k.shape[-2], options.causal_offset, q.device)
    dtype = accumulation_dtype(q.dtype)
    heads = q.shape[1]
    keys, values = (repeat_kv(x, heads).to(dtype) for x in (k, v))
    dq = torch.empty(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(keys.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(values.shape, dtype=dtype, device=q.device)
    for rows in _tiles(q, k.shape[-2]):
        seen = None if visible is None else visible[rows]
        qr = q[..., rows, :]
        p = _probabilities(_scores(qr, k, options.scale, seen), lse[..., rows], seen)
        do = dout[..., rows, :].to(dtype)
        dp = torch.matmul(do, values.transpose(-1, -2))
        p_used = p if drop is None else p * drop[..., rows, :]
        if drop is not None:
            dp = dp * drop[..., rows, :]
        delta = (do * out[..., rows, :].to(dtype)).sum(-1, keepdim=True)
        ds = p * (dp - delta) * options.scale
        if seen is not None:
            ds = torch.where(seen, ds, ds.new_zeros(()))
        dq[..., rows, :] = torch.matmul(ds, keys)
        dk += torch.matmul(ds.transpose(-1, -2), qr.to(dtype))
        dv += torch.matmul(p_used.transpose(-1, -2), do)
    dk, dv = sum_kv(dk, k.shape[1]), sum_kv(dv, v.shape[1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class ExactBottomRightKernel(BottomRightKernel):
    """A fused kernel whose native causal mask is bottom-right aligned (flash-attn, xformers),
    running this module's exact math instead when an input holds NaN or infinity: fused kernels
    multiply hidden values by zero weights (``0 * NaN`` is NaN) and treat a NaN row as empty."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not inputs_finite(options, q, k, v):
            return forward(q, k, v, options)
        return super().forward(q, k, v, options)

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not inputs_finite(options, q, k, v, dout):
            return backward(dout, q, k, v, out, lse, options)
        return super().backward(dout, q, k, v, out, lse, options)
