"""Key windows through ops whose masks are bottom-right aligned (flash-attn 2, 3 and 4, torch's
flash op): a block's window as at most three calls such ops compute exactly.

The kernel contract's window is top-left (:class:`~ringdilated.core.contract.kernel.BlockOptions`:
query ``i`` and key ``j`` both counted from the block's start, ``j`` visible iff ``i - left <=
j <= i + right``). The ops' ``window_size`` and ``causal`` are aligned to the bottom-right corner:
with ``shift = keys - rows``, row ``r`` sees key ``c`` iff ``r + shift - left <= c <= r + shift +
right`` (flash-attn's ``mask.h`` at v2.6.3 and v2.8.3, ``hopper/mask.h`` at v2.8.3,
``flash_attn/cute/mask.py`` at fa4-v4.0.0.beta27), and each op rewrites its arguments before
masking (``flash_api.cpp`` of flash-attn v2.6.3 to v2.8.3 and of torch's vendored copy: a bound
``>= seqlen_k`` becomes unbounded, and an unbounded right beside a bounded left becomes
``seqlen_k``, which hides keys from the first rows when ``rows > keys + 1``; FlashAttention 3
clamps at ``seqlen_k - 1`` and ``seqlen_q - 1``; FlashAttention 4 drops a window whose bounds sum
below 0). :func:`window_pieces` keeps every call where all of them are exact:

- ``causal`` (the op's right bound 0: the call's last row sees its last key) or no right bound;
- no left bound, or ``0 <= left < keys - 1`` (a left bound that hides nothing is passed as none);
- a call with a left bound and no right bound has at least as many keys as rows;
- every row of a call sees a key, so no op's value for a row that sees none (flash-attn 2 and
  torch's op: ``lse = +inf``) reaches the contract: rows outside every call get ``out = 0``,
  ``lse = -inf`` here. A call's keys are those some row of it sees (narrowed views, no copy).

The calls, for rows ``[first, last)`` that see a key (``-right <= i < Lk + left``):

- rows whose last key ``i + right`` is before the last key: one ``causal`` call on keys up to
  ``rows' last + right``, left bound ``left + right`` (bottom-right coordinates);
- rows that see every key from 0 to the end: one call without a mask;
- rows that see the keys from ``i - left > 0`` to the end: one call on keys from the first such
  row's ``i - left``, left bound ``keys - rows``, no right bound.

Without a left bound these are core's bottom-right pieces (:mod:`ringdilated.core.contract.causal`)
with their dropout seeds (:attr:`WindowPiece.bottom_right`). :class:`WindowKernel` is a fused
kernel built on them, its results repaired for non-finite inputs on the device.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from ringdilated.backends._dense import GuardedKernel
from ringdilated.core import (
    BlockOptions,
    BottomRightPiece,
    KeyWindow,
    backward_with_lse_by_piece,
    bottom_right_pieces,
    forward_by_piece,
)

__all__ = [
    "NativeWindowKernel",
    "PieceBackward",
    "PieceForward",
    "WindowKernel",
    "WindowPiece",
    "backward_by_window",
    "forward_by_window",
    "seen_rows",
    "window_pieces",
]


@attrs.frozen
class WindowPiece:
    """One op call: query rows ``[row_start, row_stop)`` against keys ``[key_start, key_stop)``
    under the op's bottom-right mask, ``causal`` (right bound 0) or unbounded on the right, and
    ``left`` (``None``: unbounded), in the op's own convention."""

    row_start: int
    row_stop: int
    key_start: int
    key_stop: int
    left: int | None
    causal: bool

    @classmethod
    def of(cls, piece: BottomRightPiece) -> WindowPiece:
        """The op call of core's ``piece``."""
        return cls(
            piece.row_start, piece.row_stop, piece.key_start, piece.keys, piece.left, piece.causal
        )

    @property
    def rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def keys(self) -> int:
        return self.key_stop - self.key_start

    @property
    def bottom_right(self) -> BottomRightPiece:
        """Core's piece of these rows, key stop and mask: the path of this call's dropout seed
        (:func:`~ringdilated.core.contract.causal.piece_seed`). Without a left bound it is the
        call core's pieces make, so the seeds are theirs; the pieces of one block have
        distinct rows, so their seeds are distinct."""
        return BottomRightPiece(self.row_start, self.row_stop, self.key_stop, self.causal)

    def covers(self, q_len: int, k_len: int) -> bool:
        """Whether this call is the whole ``q_len x k_len`` block."""
        return (self.row_start, self.row_stop, self.key_start, self.key_stop) == (
            0,
            q_len,
            0,
            k_len,
        )

    def rows_of(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """This call's rows of ``x`` (``q``, ``out``, ``dout``; the lse with ``dim=-1``)."""
        return x.narrow(dim, self.row_start, self.rows)

    def keys_of(self, x: torch.Tensor) -> torch.Tensor:
        """This call's keys of ``x`` (``k``, ``v``, their gradients)."""
        return x.narrow(-2, self.key_start, self.keys)


def seen_rows(q_len: int, k_len: int, window: KeyWindow) -> tuple[int, int]:
    """``(first, last)``: the rows ``[first, last)`` of a ``q_len x k_len`` block that see at
    least one key under ``window`` (:meth:`KeyWindow.visible_rows`; ``first == last``: none)."""
    first, last = window.visible_rows(q_len, k_len)
    return (first, last) if first < last else (0, 0)


def window_pieces(q_len: int, k_len: int, window: KeyWindow) -> tuple[WindowPiece, ...]:
    """The op calls that reproduce ``window`` on a ``q_len x k_len`` block, in row order: core's
    :func:`~ringdilated.core.contract.causal.bottom_right_pieces` (module docstring), each as
    the op call it is."""
    return tuple(WindowPiece.of(p) for p in bottom_right_pieces(q_len, k_len, window))


PieceForward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, WindowPiece], tuple[torch.Tensor, torch.Tensor]
]
"""``(q, k, v, piece) -> (out, lse)``: the call ``piece`` (its rows and keys) in kernel layout."""

PieceBackward = Callable[
    [
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        WindowPiece,
    ],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]
"""``(dout, dlse, q, k, v, out, lse, piece) -> (dq, dk, dv)``: the call ``piece`` in kernel layout,
the gradient of ``sum(dout * out) + sum(dlse * lse)`` (``dlse`` ``None``: of the first term)."""


def forward_by_window(
    native: PieceForward, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: KeyWindow
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the block under ``window`` from one ``native`` call per
    :func:`window_pieces` piece: core's
    :func:`~ringdilated.core.contract.causal.forward_by_piece` (one piece covering the block is
    one call whose results are returned as they are; otherwise the calls' results are added into
    zeros, the rows in no call given ``out = 0``, ``lse = -inf``), each handed its op call."""
    return forward_by_piece(lambda q, k, v, p: native(q, k, v, WindowPiece.of(p)), q, k, v, window)


def backward_by_window(
    native: PieceBackward,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: KeyWindow,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` under ``window`` from one ``native`` call per piece (the forward's
    pieces): core's :func:`~ringdilated.core.contract.causal.backward_with_lse_by_piece`, each
    call handed its rows of ``dout``, ``out``, the lse and ``dlse`` (``(N, Hq, Lq)``; ``None``:
    no lse term), its keys and its op call, the results added into zeros: pieces that share keys
    sum their gradients, rows and keys in no piece get none."""
    return backward_with_lse_by_piece(
        lambda do, dl, q, k, v, o, s, p: native(do, dl, q, k, v, o, s, WindowPiece.of(p)),
        dout, dlse, q, k, v, out, lse, window,
    )  # fmt: skip


class WindowKernel(GuardedKernel):
    """A fused kernel whose op masks with a bottom-right window: implement
    :meth:`forward_piece` and :meth:`backward_piece` (kernel layout, the piece's rows and keys,
    the block's options: its scale, softcap, dropout) and inherit the contract's ``forward`` and
    ``backward`` for any window.

    The results are repaired on the device for non-finite inputs and dropout refused unless
    :attr:`serves_dropout`, as :class:`~ringdilated.backends._dense.GuardedKernel` says (which
    also gives rows that see no key ``out = 0``, ``lse = -inf`` again).
    :meth:`unguarded_forward` and :meth:`unguarded_backward` are the calls alone."""

    def forward_piece(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        piece: WindowPiece,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The call ``piece`` of a block run with ``options``."""
        raise NotImplementedError

    def backward_piece(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        piece: WindowPiece,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The backward of the call ``piece`` (every tensor: the piece's)."""
        raise NotImplementedError

    def unguarded_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's calls, unrepaired."""

        def native(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, piece: WindowPiece
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return self.forward_piece(q, k, v, piece, options)

        return forward_by_window(native, q, k, v, options.window)

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

        def native(
            dout: torch.Tensor,
            _: torch.Tensor | None,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            out: torch.Tensor,
            lse: torch.Tensor,
            piece: WindowPiece,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.backward_piece(dout, q, k, v, out, lse, piece, options)

        return backward_by_window(native, dout, None, q, k, v, out, lse, options.window)


class NativeWindowKernel(WindowKernel):
    """A :class:`WindowKernel` without dropout whose op takes one call's mask and features as
    :meth:`native_forward` and :meth:`native_backward` do (FlashAttention 3 and 4): each piece
    runs with its ``causal`` flag and ``left`` bound, the block's scale, softcap and (backward)
    deterministic mode."""

    def native_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float,
        *,
        window_left: int | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One op call in kernel layout under the op's bottom-right mask."""
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
        *,
        deterministic: bool = False,
        window_left: int | None = None,
        softcap: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The backward of one op call, into fresh ``dq``, ``dk``, ``dv``."""
        raise NotImplementedError

    def forward_piece(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        piece: WindowPiece,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.native_forward(
            q, k, v, piece.causal, options.scale, window_left=piece.left, softcap=options.softcap
        )

    def backward_piece(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        piece: WindowPiece,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.native_backward(
            dout, q, k, v, out, lse, piece.causal, options.scale,
            deterministic=options.deterministic, window_left=piece.left, softcap=options.softcap,
        )  # fmt: skip
