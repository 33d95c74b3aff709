"""Dense softmax attention for one block, exact for non-finite inputs.

The ``reference`` kernel is this math, and every fused built-in kernel (sdpa on CPU and CUDA,
flash, xformers, flex) falls back to it when an input holds NaN or infinity: PyTorch's CPU flash
kernel turns a NaN query row into ``out = 0``, ``lse = 0`` and spreads a NaN value to queries
that never see it, and fused kernels in general multiply hidden values by zero weights. The check
is one summing pass over the inputs and one host read per call.

Semantics, for every query row (docs/spec.md, section 4: NaN or infinity reaches exactly the
outputs that dense masked attention sends it to): attention runs over the row's
*visible* keys only. A hidden key takes no part, whatever it holds: its score is replaced by
``-inf`` before the softmax, and its value is never multiplied by the zero weight (``0 * NaN``
would be NaN), so a NaN or infinite key or value reaches exactly the queries that see it. A row
with no visible key gives ``out = 0`` and ``lse = -inf``; a row whose visible scores are all
``-inf`` (infinite inputs) gives what softmax gives, NaN, with ``lse = -inf``.
"""

from __future__ import annotations

import torch

from ringdilated.backends._heads import repeat_kv, sum_kv
from ringdilated.core.accumulator import accumulation_dtype
from ringdilated.core.causal import BottomRightKernel
from ringdilated.core.kernel import BlockOptions

__all__ = [
    "ExactBottomRightKernel",
    "all_finite",
    "backward",
    "forward",
    "visible_keys",
    "weighted_values",
]

#: Elements of the ``rows x keys x dim`` products of :func:`weighted_values`' exact path per step.
_EXACT_BUDGET = 1 << 24


def all_finite(*tensors: torch.Tensor) -> bool:
    """Whether no element of ``tensors`` is NaN or infinite: one reduction pass and one host
    read (a sum is non-finite whenever an element is; an overflowing sum of finite values only
    sends the call to the exact path, which is still right)."""
    totals = [t.sum(dtype=accumulation_dtype(t.dtype)) for t in tensors]
    return bool(torch.isfinite(torch.stack(totals)).all())


def visible_keys(
    q_len: int, k_len: int, offset: int | None, device: torch.device
) -> torch.Tensor | None:
    """``(q_len, k_len)`` bool: key ``j`` visible to query ``i`` (``None``: every key)."""
    if offset is None:
        return None
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    return torch.arange(k_len, device=device) <= rows + offset


def weighted_values(p: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None) -> torch.Tensor:
    """``sum_j p_ij v_j`` over visible ``j`` only. ``p`` ``(N, H, Lq, Lk)``, ``v`` ``(N, H, Lk,
    D)``. A matmul when ``v`` is finite; otherwise hidden entries are dropped before the product,
    so a NaN or infinite value never reaches a query that does not see it."""
    if visible is None or all_finite(v):
        return torch.matmul(p, v)
    out = p.new_empty(*p.shape[:-1], v.shape[-1])
    rows = max(1, _EXACT_BUDGET // max(1, p.shape[-1] * v.shape[-1] * p.shape[0] * p.shape[1]))
    for start in range(0, p.shape[-2], rows):
        stop = min(p.shape[-2], start + rows)
        terms = p[..., start:stop, :, None] * v[..., None, :, :]
        keep = visible[start:stop, :, None]
        out[..., start:stop, :] = torch.where(keep, terms, terms.new_zeros(())).sum(-2)
    return out


def _scores(
    q: torch.Tensor, k: torch.Tensor, options: BlockOptions, visible: torch.Tensor | None
) -> torch.Tensor:
    dtype = accumulation_dtype(q.dtype)
    kd = repeat_kv(k, q.shape[1]).to(dtype)
    scores = torch.matmul(q.to(dtype), kd.transpose(-1, -2)) * options.scale
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
    empty = torch.isneginf(lse) & ~visible.any(-1)
    finite = torch.where(empty, torch.zeros_like(lse), lse)
    return torch.exp(scores - finite.unsqueeze(-1))


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: BlockOptions,
    drop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the block; ``drop`` scales the probabilities (dropout, already
    divided by the keep probability)."""
    visible = visible_keys(q.shape[-2], k.shape[-2], options.causal_offset, q.device)
    scores = _scores(q, k, options, visible)
    lse = torch.logsumexp(scores, dim=-1)
    p = _probabilities(scores, lse, visible)
    if drop is not None:
        p = p * drop
    out = weighted_values(p, repeat_kv(v, q.shape[1]).to(p.dtype), visible)
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
    scores = _scores(q, k, options, visible)
    p = _probabilities(scores, lse, visible)
    dtype = p.dtype
    heads = q.shape[1]
    do = dout.to(dtype)
    dp = torch.matmul(do, repeat_kv(v, heads).to(dtype).transpose(-1, -2))
    p_used = p if drop is None else p * drop
    if drop is not None:
        dp = dp * drop
    delta = (do * out.to(dtype)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * options.scale
    if visible is not None:
        ds = torch.where(visible, ds, ds.new_zeros(()))
    dq = torch.matmul(ds, repeat_kv(k, heads).to(dtype))
    dk = sum_kv(torch.matmul(ds.transpose(-1, -2), q.to(dtype)), k.shape[1])
    dv = sum_kv(torch.matmul(p_used.transpose(-1, -2), do), v.shape[1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class ExactBottomRightKernel(BottomRightKernel):
    """A fused kernel whose native causal mask is bottom-right aligned (flash-attn, xformers),
    running this module's exact math instead when an input holds NaN or infinity: fused kernels
    multiply hidden values by zero weights (``0 * NaN`` is NaN) and treat a NaN row as empty."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not all_finite(q, k, v):
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
        if not all_finite(q, k, v, dout):
            return backward(dout, q, k, v, out, lse, options)
        return super().backward(dout, q, k, v, out, lse, options)
