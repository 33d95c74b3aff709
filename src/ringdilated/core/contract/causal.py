"""Key windows for kernels whose only masks are "bottom-right" aligned.

The kernel contract (:mod:`ringdilated.core.contract.kernel`) asks for any key window
(``BlockOptions.window``): key ``j`` is visible to query ``i`` iff ``i - left <= j <= i + right``,
top-left aligned (both counted from the block's start). Many fused kernels (flash-attn 2.1+,
xformers' ``LowerTriangularFromBottomRightMask``) align their masks to the bottom-right corner
instead: with ``d = Lk - Lq``, key ``j`` visible iff ``j <= i + d`` (causal) and, for those with a
local window (flash-attn's ``window_size=(left, right)``), ``j >= i + d - left``. Any window
reduces to at most three such calls, each on a contiguous run of rows and of keys:

- rows outside :meth:`~ringdilated.core.plan.window.KeyWindow.visible_rows` see no key (output
  0, lse ``-inf``): before ``-right``, and with a left bound from ``Lk + left`` on;
- rows whose limit ``i + right`` is before the last key: one causal call on keys up to the
  rows' last ``+ right`` (a diagonal block, ``right = 0`` with ``Lq = Lk``, is one call on all
  its keys), left bound ``left + right`` in bottom-right terms;
- rows that see every key from 0 to the last: one call without a mask;
- rows that see the keys from ``i - left > 0`` to the last: one call on keys from the first such
  row's ``i - left``, left bound ``keys - rows``, no right bound.

Every call is exact under each op's own rewriting of its window arguments (flash-attn 2 and
torch's copy drop a bound ``>= seqlen_k`` and turn "no right bound" beside a left one into
``seqlen_k``; FlashAttention 3 clamps at ``seqlen_k - 1`` and ``seqlen_q - 1``; FlashAttention 4
drops a window whose bounds sum below 0: ``flash_api.cpp`` of flash-attn v2.6.3 to v2.8.3,
``hopper/flash_api.cpp`` at v2.8.3, ``flash_attn/cute/interface.py`` at fa4-v4.0.0.beta27):
a left bound is set only when it hides a key (``0 <= left < keys - 1``), and a call with a left
bound and no right bound has at least as many keys as rows. Each piece's keys start at the first
its first row sees (:attr:`BottomRightPiece.key_start`). Without a left bound the pieces are
0.1's (keys from 0, ``left=None``) and keep 0.1's dropout seeds.

No piece contains an empty row, so a kernel's own convention for empty rows never matters.
:func:`forward_by_piece` and :func:`backward_by_piece` run a native call over the pieces, handing
it each piece (a kernel with dropout derives the piece's seed from it, :func:`piece_seed`);
:func:`backward_with_lse_by_piece` does so for a native backward that also takes the lse's
gradient, each piece getting its rows of ``dlse`` (rows in no piece see no key: their lse is a
constant). :func:`forward_in_pieces` and :func:`backward_in_pieces` do the same for a native
call that takes the mask flag only (no left bound). :class:`BottomRightKernel` is a kernel built
on them.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch

from ringdilated.core.contract.accumulator import accumulation_dtype
from ringdilated.core.contract.kernel import BlockOptions, derive_seed
from ringdilated.core.plan.window import KeyWindow

__all__ = [
    "BottomRightKernel",
    "BottomRightPiece",
    "NativeBackward",
    "NativeForward",
    "PieceBackward",
    "PieceForward",
    "PieceLseBackward",
    "backward_by_piece",
    "backward_in_pieces",
    "backward_with_lse_by_piece",
    "bottom_right_pieces",
    "forward_by_piece",
    "forward_in_pieces",
    "piece_seed",
    "right_bound",
]


@attrs.frozen
class BottomRightPiece:
    """Query rows ``[row_start, row_stop)`` against keys ``[key_start, keys)``; in the piece's
    own coordinates (row ``i`` is ``row_start + i``, key ``j`` is ``key_start + j``) and with
    ``d = (keys - key_start) - (row_stop - row_start)``, key ``j`` is visible to row ``i`` iff
    ``j <= i + d`` when ``causal`` and ``j >= i + d - left`` when ``left`` is not ``None``:
    flash-attn's ``window_size=(left, 0)`` (``causal``) or ``(left, -1)``, ``-1`` for ``None``.
    ``left >= 0`` whenever set."""

    row_start: int
    row_stop: int
    keys: int
    causal: bool
    key_start: int = 0
    left: int | None = None

    @property
    def rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def key_count(self) -> int:
        return self.keys - self.key_start


def _as_window(window: KeyWindow | int | None) -> KeyWindow:
    """``window``, or 0.1's right bound (``offset``, an int or ``None``) as a window."""
    return window if isinstance(window, KeyWindow) else KeyWindow(None, window)


def bottom_right_pieces(
    q_len: int, k_len: int, window: KeyWindow | int | None
) -> tuple[BottomRightPiece, ...]:
    """The calls that reproduce ``window`` (a :class:`~ringdilated.core.plan.window.KeyWindow`,
    or 0.1's ``window.right`` as an int or ``None``) with bottom-right masks only."""
    window = _as_window(window)
    if not (q_len and k_len):
        return ()
    right = window.right
    if window.left is None:  # 0.1's pieces, keys from 0
        if right is None or right >= k_len - 1:
            return (BottomRightPiece(0, q_len, k_len, False),)
        first = min(q_len, max(0, -right))
        split = min(q_len, max(first, k_len - right))  # rows from here see every key
        pieces = []
        if split > first:
            pieces.append(BottomRightPiece(first, split, split + right, True))
        if q_len > split:
            pieces.append(BottomRightPiece(split, q_len, k_len, False))
        return tuple(pieces)
    left = window.left
    first, last = window.visible_rows(q_len, k_len)
    if first == last:
        return ()
    if right is not None and right >= k_len - 1:  # hides nothing on the right
        right = None
    # Rows before ``split`` see up to i + right <= Lk - 1; rows before ``whole`` see from key 0.
    split = first if right is None else min(last, max(first, k_len - right))
    whole = min(last, max(split, left + 1))
    pieces = []
    if split > first:  # keys to split + right: the right bound is bottom-right
        assert right is not None
        start = max(0, first - left)
        masked = split - 1 - left > start  # the last row hides a key: the left bound matters
        pieces.append(
            BottomRightPiece(
                first, split, split + right, True, start, left + right if masked else None
            )
        )
    if whole > split:  # every key, no mask
        pieces.append(BottomRightPiece(split, whole, k_len, False))
    if last > whole:  # from i - left > 0 to the last key; a single row needs no left bound
        start = whole - left
        bound = (k_len - start) - (last - whole) if last - whole > 1 else None
        pieces.append(BottomRightPiece(whole, last, k_len, False, start, bound))
    return tuple(pieces)


PieceForward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, BottomRightPiece], tuple[torch.Tensor, torch.Tensor]
]
"""``(q, k, v, piece) -> (out, lse)``: the call ``piece`` (its rows of ``q``, its keys of ``k``
and ``v``; ``piece.causal``: the bottom-right mask) in kernel layout."""

PieceBackward = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        BottomRightPiece,
    ],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]
"""``(dout, q, k, v, out, lse, piece) -> (dq, dk, dv)``: the call ``piece`` in kernel layout."""

PieceLseBackward = Callable[
    [
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        BottomRightPiece,
    ],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]
"""``(dout, dlse, q, k, v, out, lse, piece) -> (dq, dk, dv)``: the call ``piece`` in kernel
layout, the gradient of ``sum(dout * out) + sum(dlse * lse)`` (``dlse`` ``None``: of the first
term only)."""

NativeForward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]
]
"""``(q, k, v, bottom_right_causal) -> (out, lse)`` in kernel layout."""

NativeBackward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, bool],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
]
"""``(dout, q, k, v, out, lse, bottom_right_causal) -> (dq, dk, dv)`` in kernel layout."""


def piece_seed(dropout_seed: int, piece: BottomRightPiece) -> int:
    """The dropout seed of the call ``piece`` of a block seeded with ``dropout_seed``: a pure
    function of the two, so a backward, which makes the same pieces of the same block, derives
    the forward's seeds; distinct for the pieces of one block (their rows differ), each unrelated
    to ``dropout_seed`` in every bit (:func:`~ringdilated.core.contract.kernel.derive_seed`)."""
    shape: tuple[int, ...] = (piece.row_start, piece.row_stop, piece.keys, int(piece.causal))
    if piece.key_start or piece.left is not None:  # 0.1's pieces keep 0.1's seeds
        shape += (piece.key_start, -1 if piece.left is None else piece.left)
    return derive_seed(dropout_seed, "bottom-right piece", *shape)


def _whole(pieces: tuple[BottomRightPiece, ...], q_len: int, k_len: int) -> bool:
    """Whether ``pieces`` is one call on the whole block (any mask): its results are the block's."""
    if len(pieces) != 1:
        return False
    p = pieces[0]
    return (p.row_start, p.row_stop, p.key_start, p.keys) == (0, q_len, 0, k_len)


# narrow and add_, not slicing and copy_: a CPU-only torch has neither for fake CUDA tensors.
def _rows(x: torch.Tensor, piece: BottomRightPiece, dim: int = -2) -> torch.Tensor:
    return x.narrow(dim, piece.row_start, piece.row_stop - piece.row_start)


def _keys(x: torch.Tensor, piece: BottomRightPiece) -> torch.Tensor:
    return x.narrow(-2, piece.key_start, piece.key_count)


def forward_by_piece(
    native: PieceForward,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: KeyWindow | int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` for ``window`` (a :class:`~ringdilated.core.plan.window.KeyWindow`, or
    0.1's ``window.right``) from bottom-right-only ``native`` calls, one per
    :func:`bottom_right_pieces` piece, each handed its piece. One piece covering the block
    is one call whose results are returned as they are; otherwise the pieces' results are added
    into zeros, the rows no piece holds (they see no key) left at ``out = 0``, ``lse = -inf``.
    Only ``narrow``, ``fill_`` and ``add_`` touch the results: no copy, no index assignment."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    pieces = bottom_right_pieces(q_len, k_len, window)
    if _whole(pieces, q_len, k_len):
        return native(q, k, v, pieces[0])
    out = q.new_zeros(*q.shape[:-1], v.shape[-1])
    lse = q.new_zeros(q.shape[:-1], dtype=accumulation_dtype(q.dtype))
    seeing = pieces[0].row_start if pieces else q_len  # the rows before it see no key
    lse.narrow(-1, 0, seeing).fill_(float("-inf"))
    after = pieces[-1].row_stop if pieces else q_len  # nor do the rows from here on
    lse.narrow(-1, after, q_len - after).fill_(float("-inf"))
    for p in pieces:
        part, part_lse = native(_rows(q, p), _keys(k, p), _keys(v, p), p)
        _rows(out, p).add_(part)
        _rows(lse, p, -1).add_(part_lse)
    return out, lse


def backward_by_piece(
    native: PieceBackward,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: KeyWindow | int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` for ``window`` (or 0.1's ``window.right``) from bottom-right-only
    ``native`` calls, each handed its piece (the same pieces as :func:`forward_by_piece`'s),
    added into zeros: the pieces share keys, whose gradients they sum."""
    return backward_with_lse_by_piece(
        lambda do, _, q, k, v, o, s, p: native(do, q, k, v, o, s, p),
        dout, None, q, k, v, out, lse, window,
    )  # fmt: skip


def backward_with_lse_by_piece(
    native: PieceLseBackward,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: KeyWindow | int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`backward_by_piece` of ``sum(dout * out) + sum(dlse * lse)``: each call is also
    handed its rows of ``dlse`` (``(N, Hq, Lq)``; ``None``: no lse term)."""
    q_len, k_len = q.shape[-2], k.shape[-2]
    pieces = bottom_right_pieces(q_len, k_len, window)
    if _whole(pieces, q_len, k_len):
        return native(dout, dlse, q, k, v, out, lse, pieces[0])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for p in pieces:
        gq, gk, gv = native(
            _rows(dout, p),
            None if dlse is None else _rows(dlse, p, -1),
            _rows(q, p),
            _keys(k, p),
            _keys(v, p),
            _rows(out, p),
            _rows(lse, p, -1),
            p,
        )
        _rows(dq, p).add_(gq)
        _keys(dk, p).add_(gk)
        _keys(dv, p).add_(gv)
    return dq, dk, dv


def _flag(piece: BottomRightPiece) -> bool:
    """The one mask flag of a call that takes nothing else: ``piece.causal``; a piece with a
    left bound raises ``NotImplementedError`` (a flag cannot say it)."""
    if piece.left is not None:
        raise NotImplementedError(
            f"{piece!r} has a left bound, which a native call taking the causal flag only "
            "cannot serve"
        )
    return piece.causal


def forward_in_pieces(
    native: NativeForward,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: KeyWindow | int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward_by_piece` for a ``native`` call that takes the mask flag only
    (``NotImplementedError`` for a piece with a left bound)."""
    return forward_by_piece(lambda q, k, v, p: native(q, k, v, _flag(p)), q, k, v, window)


def backward_in_pieces(
    native: NativeBackward,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    window: KeyWindow | int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`backward_by_piece` for a ``native`` call that takes the mask flag only
    (``NotImplementedError`` for a piece with a left bound)."""
    return backward_by_piece(
        lambda do, q, k, v, o, s, p: native(do, q, k, v, o, s, _flag(p)),
        dout, q, k, v, out, lse, window,
    )  # fmt: skip


class BottomRightKernel:
    """Base for kernels whose native causal mask is bottom-right aligned: implement
    :meth:`native_forward` and :meth:`native_backward` (kernel layout, ``causal`` meaning the
    bottom-right mask) and inherit the contract's ``forward``/``backward`` for any window
    bounded on the right only.

    Each call of a block goes through :meth:`forward_piece` / :meth:`backward_piece`, handed its
    :class:`BottomRightPiece` and the block's options; by default they call the native methods
    with the piece's mask and ``options.scale`` (a piece with a left bound raises
    ``NotImplementedError``: the native methods take the causal flag only). A kernel whose
    calls need more (a dropout seed per piece, :func:`piece_seed`; ``options.deterministic``;
    a local window, ``piece.left`` and ``piece.key_start``, for a kernel declaring
    ``Capabilities.sliding_window``) overrides them instead (and then need not implement the
    native methods)."""

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

    def forward_piece(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        piece: BottomRightPiece,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The call ``piece`` of a block run with ``options`` (``q``, ``k``, ``v``: the piece's)."""
        return self.native_forward(q, k, v, _flag(piece), options.scale)

    def backward_piece(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        piece: BottomRightPiece,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The backward of the call ``piece`` (every tensor: the piece's)."""
        return self.native_backward(dout, q, k, v, out, lse, _flag(piece), options.scale)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        def native(
            q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, piece: BottomRightPiece
        ) -> tuple[torch.Tensor, torch.Tensor]:
            return self.forward_piece(q, k, v, piece, options)

        return forward_by_piece(native, q, k, v, options.window)

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
        def native(
            dout: torch.Tensor,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            out: torch.Tensor,
            lse: torch.Tensor,
            piece: BottomRightPiece,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            return self.backward_piece(dout, q, k, v, out, lse, piece, options)

        return backward_by_piece(native, dout, q, k, v, out, lse, options.window)


def right_bound(options: BlockOptions) -> int | None:
    """The window's right bound, for the pieces of a kernel that serves no left bound (0.1's
    pieces take it; newer code passes ``options.window``). Raises ``NotImplementedError`` for a
    window bounded on the left."""
    if options.window.left is not None:
        raise NotImplementedError(f"{options.window!r}: bottom-right masks serve no left bound")
    return options.window.right
