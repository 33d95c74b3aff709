"""Causal offsets for kernels whose only causal mask is "bottom-right" aligned.

The kernel contract (:mod:`ringdilated.core.contract.kernel`) asks for any key window bounded on
the right by ``offset`` (``BlockOptions.window.right``): key ``j`` is visible to query ``i`` iff
``j <= i + offset``. Many fused kernels (flash-attn 2.1+,
xformers' ``LowerTriangularFromBottomRightMask``) offer one mask only: key ``j`` visible iff
``j <= i + (Lk - Lq)``. Any offset reduces to at most two such calls:

- rows before ``max(0, -offset)`` see no key (output 0, lse ``-inf``);
- rows whose limit ``i + offset`` is at most the last key see a prefix of the keys, and cutting
  the keys to ``rows + offset`` makes their mask exactly bottom-right (a diagonal block,
  ``offset = 0`` with ``Lq = Lk``, is one call on all its keys);
- the remaining rows see every key and need no mask.

No piece contains an empty row, so a kernel's own convention for empty rows never matters.
:func:`forward_in_pieces` and :func:`backward_in_pieces` run a native call over the pieces;
:func:`backward_with_lse_in_pieces` a native backward that also takes the lse's gradient, each
piece getting its rows of ``dlse`` (rows in no piece see no key: their lse is a constant).
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from ringdilated.core.contract.accumulator import accumulation_dtype
from ringdilated.core.contract.kernel import BlockOptions

__all__ = [
    "BottomRightKernel",
    "BottomRightPiece",
    "NativeBackward",
    "NativeForward",
    "NativeLseBackward",
    "backward_in_pieces",
    "backward_with_lse_in_pieces",
    "bottom_right_pieces",
    "forward_in_pieces",
    "right_bound",
]


@attrs.frozen
class BottomRightPiece:
    """Query rows ``[row_start, row_stop)`` against keys ``[0, keys)``; ``causal``: bottom-right."""

    row_start: int
    row_stop: int
    keys: int
    causal: bool


def bottom_right_pieces(q_len: int, k_len: int, offset: int | None) -> tuple[BottomRightPiece, ...]:
    """The calls that reproduce ``window.right=offset`` with bottom-right masks only."""
    if not (q_len and k_len):
        return ()
    if offset is None or offset >= k_len - 1:
        return (BottomRightPiece(0, q_len, k_len, False),)
    first = min(q_len, max(0, -offset))
    split = min(q_len, max(first, k_len - offset))  # rows from here see every key
    pieces = []
    if split > first:
        pieces.append(BottomRightPiece(first, split, split + offset, True))
    if q_len > split:
        pieces.append(BottomRightPiece(split, q_len, k_len, False))
    return tuple(pieces)


NativeForward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]
]
"""``(q, k, v, bottom_right_causal) -> (out, lse)`` in kernel layout."""

NativeBackward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]
"""``(dout, q, k, v, out, lse, bottom_right_causal) -> (dq, dk, dv)`` in kernel layout."""

NativeLseBackward = Callable[
    [
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        bool,
    ],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]
"""``(dout, dlse, q, k, v, out, lse, bottom_right_causal) -> (dq, dk, dv)`` in kernel layout:
the gradient of ``sum(dout * out) + sum(dlse * lse)`` (``dlse`` ``None``: of the first term)."""


def _whole(pieces: tuple[BottomRightPiece, ...], q_len: int, k_len: int) -> bool:
    return len(pieces) == 1 and pieces[0] == BottomRightPiece(0, q_len, k_len, pieces[0].causal)


def forward_in_pieces(
    native: NativeForward, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` for ``window.right=offset`` from bottom-right-only ``native`` calls."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    pieces = bottom_right_pieces(q_len, k_len, offset)
    if _whole(pieces, q_len, k_len):
        return native(q, k, v, pieces[0].causal)
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    lse_dtype = accumulation_dtype(q.dtype)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=lse_dtype, device=q.device)
    for p in pieces:
        rows = slice(p.row_start, p.row_stop)
        o, s = native(q[..., rows, :], k[..., : p.keys, :], v[..., : p.keys, :], p.causal)
        out[..., rows, :] = o
        lse[..., rows] = s
    return out, lse


def backward_in_pieces(
    native: NativeBackward,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    offset: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` for ``window.right=offset`` from bottom-right-only ``native`` calls."""

    def without_dlse(
        dout: torch.Tensor,
        _: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return native(dout, q, k, v, out, lse, causal)

    return backward_with_lse_in_pieces(without_dlse, dout, None, q, k, v, out, lse, offset)


def backward_with_lse_in_pieces(
    native: NativeLseBackward,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    offset: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of ``sum(dout * out) + sum(dlse * lse)`` for ``window.right=offset``
    from bottom-right-only ``native`` calls, each given its rows of ``dlse`` (``(N, Hq, Lq)``;
    ``None``: no lse term, as :func:`backward_in_pieces`)."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    pieces = bottom_right_pieces(q_len, k_len, offset)
    if _whole(pieces, q_len, k_len):
        return native(dout, dlse, q, k, v, out, lse, pieces[0].causal)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for p in pieces:
        rows, keys = slice(p.row_start, p.row_stop), slice(0, p.keys)
        gq, gk, gv = native(
            dout[..., rows, :],
            None if dlse is None else dlse[..., rows],
            q[..., rows, :],
            k[..., keys, :],
            v[..., keys, :],
            out[..., rows, :],
            lse[..., rows],
            p.causal,
        )
        dq[..., rows, :] = gq
        dk[..., keys, :] += gk
        dv[..., keys, :] += gv
    return dq, dk, dv


class BottomRightKernel:
    """Base for kernels whose native causal mask is bottom-right aligned: implement
    :meth:`native_forward` and :meth:`native_backward` (kernel layout, ``causal`` meaning the
    bottom-right mask) and inherit the contract's ``forward``/``backward`` for any offset."""

    def native_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def native_backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def native(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return self.native_forward(q, k, v, causal, options.scale)

        return forward_in_pieces(native, q, k, v, right_bound(options))

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
        return backward_in_pieces(
            lambda do, q, k, v, o, s, c: self.native_backward(do, q, k, v, o, s, c, options.scale),
            dout,
            q,
            k,
            v,
            out,
            lse,
            right_bound(options),
        )


def right_bound(options: BlockOptions) -> int | None:
    """The window's right bound, for the pieces: all a bottom-right mask serves. Raises
    ``NotImplementedError`` for a window bounded on the left."""
    if options.window.left is not None:
        raise NotImplementedError(f"{options.window!r}: bottom-right masks serve no left bound")
    return options.window.right
