"""Dense softmax attention for one block, in bounded memory: the ``reference`` kernel's math.

Semantics, for every query row (the kernel contract, :mod:`ringdilated.core.contract.kernel`;
docs/spec.md, section 4): attention runs over the row's *visible* keys. A hidden key's score is
replaced by ``-inf`` before the softmax (``torch.where``, so a NaN score of a hidden key goes
too). A row with no visible key gives ``out = 0`` and ``lse = -inf``; a row whose visible scores
are all ``-inf`` (infinite inputs) gives what softmax gives, NaN, with ``lse = -inf``.

Non-finite inputs: plain masked math, with no host read. It never turns NaN or infinity into a
finite number: what the exact math makes non-finite is non-finite here. The one place it is
coarser than the exact math is ``P @ V``: a hidden key's weight is an exact zero, and ``0 * inf``
is NaN, so a non-finite value can reach the rows of its own problem that do not see it (the
kernel contract allows that; fused kernels do the same). NaN never crosses problems.

Softcapping (``options.softcap``, docs/spec.md, section 5): every score ``s = scale * q . k``
becomes ``c * tanh(s / c)`` before the mask and the softmax, and the backward multiplies each
score's gradient by the cap's derivative, ``1 - tanh(s / c)^2``, before scaling it (both
recomputed per tile from ``q`` and ``k``). A score beyond the cap saturates at ``+-c`` with a
derivative that goes to 0, as the exact math's does; an infinite score (an infinite ``q`` or
``k``) is capped to ``+-c`` as the exact math caps it.

Memory: scores are computed a tile of query rows at a time, at most ``TILE_ELEMENTS`` of them
when one query row of every problem fits (``N x H x Lk <= TILE_ELEMENTS``), else one row at a
time (no ``Lq x Lk`` matrix per problem is ever held whole).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from ringdilated.backends._heads import repeat_kv, sum_kv
from ringdilated.core import (
    FULL,
    BlockOptions,
    BottomRightKernel,
    KeyWindow,
    accumulation_dtype,
    mark_non_finite_problems,
    mark_non_finite_rows,
)

__all__ = [
    "TILE_ELEMENTS",
    "GuardedBottomRightKernel",
    "GuardedKernel",
    "backward",
    "forward",
    "refuse_dropout",
    "visible_keys",
]

#: Score elements (problems x heads x rows x keys) computed at once.
TILE_ELEMENTS = 1 << 24


def visible_keys(
    q_len: int, k_len: int, window: KeyWindow | int | None, device: torch.device
) -> torch.Tensor | None:
    """``(q_len, k_len)`` bool: key ``j`` visible to query ``i`` under ``window`` (``i - left <=
    j <= i + right``; an int or ``None``: 0.1's right bound alone), ``None`` when every key is.
    The left bound is checked first: a window is never read by its right bound alone."""
    if not isinstance(window, KeyWindow):
        window = KeyWindow(None, window)
    if window == FULL:
        return None
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    keys = torch.arange(k_len, device=device)
    if window.left is not None:
        seen = keys >= rows - window.left
        return seen if window.right is None else seen & (keys <= rows + window.right)
    assert window.right is not None
    return keys <= rows + window.right


def _tiles(q: torch.Tensor, k_len: int) -> list[slice]:
    rows = max(1, TILE_ELEMENTS // max(1, q.shape[0] * q.shape[1] * k_len))
    return [slice(i, i + rows) for i in range(0, q.shape[-2], rows)]


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    options: BlockOptions,
    visible: torch.Tensor | None,
    *,
    slope: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(scores, derivative)``: the scores of ``q`` against ``k`` in the accumulation dtype
    (``scale * q . k``, capped when ``options.softcap`` is set, ``-inf`` where a key is hidden)
    and, asked for with ``slope`` under a cap, each capped score's derivative by its uncapped
    one, ``1 - tanh(s / c)^2`` (else ``None``)."""
    dtype = accumulation_dtype(q.dtype)
    kd = repeat_kv(k, q.shape[1]).to(dtype)
    scores = torch.matmul(q.to(dtype), kd.transpose(-1, -2)) * options.scale
    derivative = None
    if options.softcap is not None:
        tanh = torch.tanh(scores / options.softcap)
        scores = tanh * options.softcap
        if slope:
            derivative = 1.0 - tanh * tanh
    if visible is not None:  # where, not an added mask: a NaN score of a hidden key goes too
        scores = torch.where(visible, scores, scores.new_full((), float("-inf")))
    return scores, derivative


def _probabilities(
    scores: torch.Tensor, lse: torch.Tensor, visible: torch.Tensor | None
) -> torch.Tensor:
    """``P = exp(s - lse)``. Rows with no visible key (``lse = -inf``) give ``P = 0``; rows
    whose visible scores are all ``-inf`` give NaN, as softmax does; so do rows whose lse is
    NaN or ``+inf`` (a score of ``+inf``: softmax is NaN there, where ``exp(s - inf)`` would
    give finite zeros). No host read: ``torch.where`` on every row."""
    lse = lse.to(scores.dtype)
    lse = torch.where(torch.isposinf(lse), lse.new_full((), float("nan")), lse)
    if visible is not None:  # a row that sees no key: lse -inf, P = 0 (not exp(-inf + inf))
        empty = torch.isneginf(lse) & visible.any(-1).logical_not()
        lse = torch.where(empty, torch.zeros_like(lse), lse)
    return torch.exp(scores - lse.unsqueeze(-1))


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    options: BlockOptions,
    drop: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the block; ``drop`` scales the probabilities (dropout, already divided
    by the keep probability), shaped like the scores."""
    visible = visible_keys(q.shape[-2], k.shape[-2], options.window, q.device)
    dtype = accumulation_dtype(q.dtype)
    values = repeat_kv(v, q.shape[1]).to(dtype)
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=dtype, device=q.device)
    lse = torch.empty(q.shape[:-1], dtype=dtype, device=q.device)
    for rows in _tiles(q, k.shape[-2]):
        seen = None if visible is None else visible[rows]
        scores, _ = _scores(q[..., rows, :], k, options, seen)
        lse[..., rows] = torch.logsumexp(scores, dim=-1)
        p = _probabilities(scores, lse[..., rows], seen)
        if drop is not None:
            p = p * drop[..., rows, :]
        out[..., rows, :] = torch.matmul(p, values)
    options.mark_empty_rows(out, lse, k.shape[-2])  # 0, not 0 * inf, where a row sees no key
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
    visible = visible_keys(q.shape[-2], k.shape[-2], options.window, q.device)
    dtype = accumulation_dtype(q.dtype)
    heads = q.shape[1]
    keys, values = (repeat_kv(x, heads).to(dtype) for x in (k, v))
    dq = torch.empty(q.shape, dtype=dtype, device=q.device)
    dk = torch.zeros(keys.shape, dtype=dtype, device=q.device)
    dv = torch.zeros(values.shape, dtype=dtype, device=q.device)
    for rows in _tiles(q, k.shape[-2]):
        seen = None if visible is None else visible[rows]
        qr = q[..., rows, :]
        scores, slope = _scores(qr, k, options, seen, slope=True)
        p = _probabilities(scores, lse[..., rows], seen)
        do = dout[..., rows, :].to(dtype)
        dp = torch.matmul(do, values.transpose(-1, -2))
        p_used = p if drop is None else p * drop[..., rows, :]
        if drop is not None:
            dp = dp * drop[..., rows, :]
        delta = (do * out[..., rows, :].to(dtype)).sum(-1, keepdim=True)
        ds = p * (dp - delta) * options.scale
        if slope is not None:  # through the cap: d(c * tanh(s / c)) / ds = 1 - tanh(s / c)^2
            ds = ds * slope
        if seen is not None:
            ds = torch.where(seen, ds, ds.new_zeros(()))
        dq[..., rows, :] = torch.matmul(ds, keys)
        dk += torch.matmul(ds.transpose(-1, -2), qr.to(dtype))
        dv += torch.matmul(p_used.transpose(-1, -2), do)
    dk, dv = sum_kv(dk, k.shape[1]), sum_kv(dv, v.shape[1])
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def refuse_dropout(name: str, options: BlockOptions) -> None:
    """Raise ``NotImplementedError`` for ``options.dropout_p > 0``: for a kernel without dropout
    called directly (its spec refuses dropout, so the resolver never sends it)."""
    if options.dropout_p:
        raise NotImplementedError(f"{name} has no dropout (dropout_p={options.dropout_p})")


class GuardedKernel:
    """The repair of a fused kernel's results for non-finite inputs, around the calls
    :meth:`unguarded_forward` and :meth:`unguarded_backward` (which a subclass implements):
    flash-style kernels return zeros for a row whose scores are all ``-inf`` (flash-attn's
    ``softmax.h``: a zero row sum gives ``inv_sum = 1``; torch's memory-efficient epilogue:
    ``s_prime == 0`` gives ``1``), which an infinite query or key produces.
    :func:`~ringdilated.core.contract.kernel.mark_non_finite_rows` (which also gives rows that
    see no key ``out = 0``, ``lse = -inf`` again) and
    :func:`~ringdilated.core.contract.kernel.mark_non_finite_problems` make the rows and
    problems that hold NaN or infinity NaN, as the kernel contract allows, with no host read.

    Dropout is refused (``NotImplementedError``) unless the class sets :attr:`serves_dropout`
    (its calls then draw it, a seed per piece:
    :func:`~ringdilated.core.contract.causal.piece_seed`)."""

    #: Whether this kernel's calls draw dropout themselves (else ``dropout_p > 0`` is refused).
    serves_dropout: ClassVar[bool] = False

    def unguarded_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's calls, unrepaired."""
        raise NotImplementedError

    def unguarded_backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block's backward calls, unrepaired."""
        raise NotImplementedError

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.serves_dropout:
            refuse_dropout(type(self).__name__, options)
        out, lse = self.unguarded_forward(q, k, v, options)
        mark_non_finite_rows(out, lse, q, k, v, options)  # then rows that see no key again
        return out, lse

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
        if not self.serves_dropout:
            refuse_dropout(type(self).__name__, options)
        dq, dk, dv = self.unguarded_backward(dout, q, k, v, out, lse, options)
        mark_non_finite_problems(
            dq, dk, dv, dout, q, k, v, lse, forward_marked=True, options=options
        )
        return dq, dk, dv


class GuardedBottomRightKernel(GuardedKernel, BottomRightKernel):
    """A fused kernel whose native causal mask is bottom-right aligned (xformers), its calls
    those of :class:`~ringdilated.core.contract.causal.BottomRightKernel` (right bounds only),
    repaired as :class:`GuardedKernel` says."""

    def unguarded_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return BottomRightKernel.forward(self, q, k, v, options)

    def unguarded_backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return BottomRightKernel.backward(self, dout, q, k, v, out, lse, options)
