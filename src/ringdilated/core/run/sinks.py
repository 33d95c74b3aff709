"""Attention sinks (docs/spec.md, section 5): a per-head logit that joins every query's softmax.

A sink ``s_h`` of query head ``h`` adds ``exp(s_h)`` to the denominator of every query of that
head, with a zero value. It is one more partial result of each query, with ``out = 0`` and
``lse = s_h``, merged once, after the call's own ``lse`` is final (every pattern, block and
piece merged; in ``longnet`` mode the union of the patterns, so the sink joins it once)::

    lse' = logaddexp(lse, s_h)        out' = out * exp(lse - lse')

A query that sees no key (``lse = -inf``) gets ``out' = 0`` and ``lse' = s_h``; a padded
position is no query and keeps ``out' = 0``, ``lse' = -inf`` (``padding``); a NaN sink makes its
head's rows NaN, never a silent 0 (the float64 oracle's rules, ``ringdilated.testing.oracle``).

Backward. The kernel contract's backward takes the *final, merged* ``out`` and ``lse`` of each
query (:mod:`ringdilated.core.contract.kernel`), and with the sink those are ``out'`` and
``lse'``: ``P' = exp(S - lse')`` already carries the sink's share of the denominator, and
``D' = rowsum(dout' * out')``, so the blocks' gradients of ``sum(dout' * out') + sum(dlse' *
lse')`` are the call's ordinary backward handed ``out'``, ``lse'`` and the caller's own
``dout'``, ``dlse'`` (no ``dlse`` arises from the merge itself). The sink's own gradient is
``exp(s_h - lse') * (dlse' - rowsum(dout' * out'))`` summed over the head's rows.

Both run on the device: no host read, no collective (on a process group each rank merges its
own positions; its sink gradient is its positions' share, summed across ranks as every
parameter's gradient is). Arithmetic in the lse's dtype, the call's accumulation dtype; the
sinks are converted to it exactly (the call's validation refuses a dtype that would round).
"""

from __future__ import annotations

import torch

__all__ = ["merge_sinks", "sinks_gradient"]


def _logits(sinks: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``sinks`` ``(H,)`` as ``(1, H, 1)`` in ``lse``'s dtype, broadcast against ``(B, H, L)``."""
    return sinks.to(lse.dtype).view(1, -1, 1)


def merge_sinks(
    out: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor,
    padding: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out', lse')``: ``out`` ``(B, L, H, Dv)`` and its final ``lse`` ``(B, H, L)`` with the
    sink of each head merged in (module docstring). ``out'`` is in ``out``'s dtype (scaled in
    ``lse``'s, then rounded once), ``lse'`` in ``lse``'s dtype (and memory layout, as torch's
    elementwise ops keep it). ``padding``: ``(B or 1, L)`` bool, ``True`` at the positions that
    are no query (padding), which keep ``lse' = -inf``. Neither input is modified; plain
    differentiable torch ops (the
    decoding cache differentiates through them; a call's autograd node uses
    :func:`sinks_gradient`)."""
    merged = torch.logaddexp(lse, _logits(sinks, lse))  # lse's strides (TensorIterator's)
    if padding is not None:
        merged = merged.masked_fill(padding.unsqueeze(1), float("-inf"))
    # No key: 0 (not NaN), unless the sink is NaN: then NaN, never a silent 0.
    empty = torch.isneginf(lse) & ~torch.isnan(merged)
    share = torch.where(empty, 0.0, torch.exp(lse - merged))
    scaled = out * share.transpose(1, 2).unsqueeze(-1)
    return scaled.to(out.dtype), merged


def sinks_gradient(
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """The gradient of ``sum(dout * out) + sum(dlse * lse)`` for ``sinks`` ``(H,)``, in its
    dtype, given the merged ``out`` ``(B, L, H, Dv)`` and ``lse`` ``(B, H, L)`` of
    :func:`merge_sinks` and their gradients (``dlse``: ``None`` when none flows):
    ``sum over (b, p) of exp(s_h - lse') * (dlse' - rowsum(dout' * out'))``. A row whose
    ``lse'`` is ``-inf`` (no key and a sink of ``-inf``) adds nothing."""
    dtype = lse.dtype
    share = torch.exp(_logits(sinks, lse) - lse).masked_fill(torch.isneginf(lse), 0.0)
    delta = (dout.to(dtype) * out.to(dtype)).sum(-1).transpose(1, 2)  # (B, H, L)
    pull = -delta if dlse is None else dlse.to(dtype) - delta
    return (share * pull).sum((0, 2)).to(sinks.dtype)
