"""Kernel calls held to a kernel's :class:`~ringdilated.core.select.capabilities.BatchLimit`.

A call holds at most ``limit.per_call(kv_heads)`` problems (the ``N`` of the kernel layout) and at
most ``limit.query_elements`` query elements (problems x query heads x rows x head dim). Problems
are independent, so a call splits along ``N``. One problem larger than the query bound splits
along its query rows (:func:`row_chunks`), which are independent too: a chunk keeps every key of
its problem and the block's window shifted to its first row (query ``i`` of a chunk starting at
row ``r`` is row ``r + i``: ``window.shifted(r)``, so ``right + r`` and ``left - r``). Forward
``out`` and ``lse`` rows, and backward ``dq`` rows, are put together; ``dk`` and ``dv`` are the
sum over a problem's row chunks.

Dropout. A kernel draws a call's mask from its seed and the call's shape, so a problem split
into row chunks cannot draw the mask its unsplit call would: each chunk draws its own, from a
seed of its own (one seed for two chunks would repeat one mask pattern in both). The chunking is
a function of shapes and the bound only, so forward and backward split alike and the backward
replays every chunk's mask: a block's mask is a function of its seed *and its chunking*. Each
chunk's mask is a kernel's own draw, so the conformance kit's ``dropout`` check (the mask read
back, its rate, one seed one mask, the backward under it) holds a split call to the same rules
as any call (tests/test_row_chunks.py runs the kit through :class:`BatchLimitedKernel`); that
chunks draw distinct masks is tested there too (the kit does not look for repeats).

The single-process driver splits its steps by segments and, within a problem, by
:func:`row_chunks` (:mod:`ringdilated.core.run.local`; each row chunk is a step, seeded by its
number); :class:`BatchLimitedKernel` splits calls the driver cannot (a sharded run's crossing
pieces: one problem per batch row, every row of a segment).
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import torch

from ringdilated.core.contract.accumulator import accumulation_dtype
from ringdilated.core.contract.kernel import BlockOptions, Kernel, derive_seed
from ringdilated.core.contract.lse import backward_with_lse
from ringdilated.core.plan.window import KeyWindow
from ringdilated.core.select.capabilities import BatchLimit

__all__ = ["WINDOW_CHUNK_ROWS", "BatchLimitedKernel", "RowChunk", "row_chunks", "window_chunk_rows"]


#: The fewest query rows a chunk made for a window's sake holds (:func:`row_chunks`): below it
#: a chunk's keys are mostly the window's width, and each more call costs a launch and the
#: driver's Python.
WINDOW_CHUNK_ROWS = 256


@attrs.frozen
class RowChunk:
    """Query rows ``[start, stop)`` of a call, the keys ``[key_start, key_stop)`` they see
    (``key_stop`` ``None``: every key of the call), and the call's ``options`` with the window
    shifted to row ``start`` and key ``key_start`` (the chunk's own coordinates). Dropout seeds
    are the caller's to set."""

    start: int
    stop: int
    options: BlockOptions
    key_start: int = 0
    key_stop: int | None = None

    @property
    def rows(self) -> int:
        return self.stop - self.start

    @property
    def sees_keys(self) -> bool:
        """Whether any row of the chunk sees a key (a chunk that does not is not computed:
        its rows give ``out = 0``, ``lse = -inf`` and no gradient)."""
        return self.key_stop is None or self.key_stop > self.key_start

    def keys(self, x: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """The chunk's keys of ``x`` (``k``, ``v`` or their gradients) along ``dim``."""
        if self.key_stop is None:
            return x
        return x.narrow(dim, self.key_start, self.key_stop - self.key_start)


def window_chunk_rows(window: KeyWindow, rows: int, k_len: int) -> int | None:
    """Rows a chunk holds so that a window bounded on both sides (a band, ``width = left +
    right + 1`` keys a row) costs about ``rows x (chunk + width)`` scores instead of ``rows x
    k_len``: ``max(WINDOW_CHUNK_ROWS, width)``, when that is less than a quarter of ``k_len``
    and than ``rows``; ``None`` otherwise (chunking would save little)."""
    if window.left is None or window.right is None:
        return None
    width = window.left + window.right + 1
    chunk = max(WINDOW_CHUNK_ROWS, width)
    return chunk if 4 * (chunk + width) <= k_len and chunk < rows else None


def row_chunks(
    rows: int,
    row_elements: int,
    budget: int | None,
    options: BlockOptions,
    k_len: int | None = None,
    bands: bool = True,
) -> Iterator[RowChunk]:
    """A call's ``rows`` query rows, first to last, in chunks of at most ``budget`` query
    elements (``row_elements`` a row: problems x query heads x head dim), at least one row a
    chunk; one chunk of every row when they fit or ``budget`` is ``None`` (``options``
    unchanged).

    With ``k_len`` (the call's keys), each chunk holds only the keys its rows see
    (:meth:`~ringdilated.core.plan.window.KeyWindow.visible_keys`, ``(0, 0)`` when none: the
    caller skips it), and with ``bands`` (a kernel that computes every score it is handed:
    ``not BatchLimit.skips_hidden_keys``) a window bounded on both sides is chunked further
    (:func:`window_chunk_rows`): a sliding window over a long block costs about ``rows x
    (window + chunk)`` scores. Without ``k_len``, every chunk keeps every key (0.1's chunks)."""
    window = options.window
    per_chunk = rows if budget is None else max(1, budget // max(1, row_elements))
    banded = None if k_len is None or not bands else window_chunk_rows(window, rows, k_len)
    if banded is not None:
        per_chunk = min(per_chunk, banded)
    if per_chunk >= rows:
        per_chunk = rows
    for start in range(0, rows, per_chunk):
        stop = min(rows, start + per_chunk)
        if k_len is None:
            if per_chunk == rows:
                yield RowChunk(0, rows, options)
            else:
                yield RowChunk(start, stop, attrs.evolve(options, window=window.shifted(start)))
            continue
        first, last = window.visible_keys(start, stop, k_len)
        if (first, last) == (0, k_len):
            shifted, key_stop = window.shifted(start), None
        else:
            shifted, key_stop = window.shifted(start - first), last
        chunk_options = options if shifted == window else attrs.evolve(options, window=shifted)
        yield RowChunk(start, stop, chunk_options, first, key_stop)


@attrs.frozen
class _Piece:
    """Problems ``[first, first + count)`` and query rows ``chunk`` of a split call."""

    first: int
    count: int
    chunk: RowChunk

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """This piece of a query-side tensor (``q``, ``out``, ``dout``; the lse's ``(N, H,
        Lq)``): its problems and rows."""
        return x.narrow(0, self.first, self.count).narrow(2, self.chunk.start, self.chunk.rows)

    def keys(self, x: torch.Tensor) -> torch.Tensor:
        """This piece of ``k`` or ``v``: its problems, the keys its rows see."""
        return self.chunk.keys(x.narrow(0, self.first, self.count))


class BatchLimitedKernel:
    """``kernel`` with every call held to ``limit``: split along ``N`` into pieces of at most
    ``limit.per_call(kv_heads)`` problems and ``limit.query_elements`` query elements, and a
    problem larger than that along its query rows (:func:`row_chunks`); results as the one call's
    (``dk``, ``dv`` of a problem's row chunks summed in the accumulation dtype, then cast).

    A key window also splits a call (:func:`row_chunks` with the keys): each piece holds only
    the keys its rows see, a window bounded on both sides is chunked into bands, and a piece
    whose rows see no key is not computed (its rows give ``out = 0``, ``lse = -inf``, no
    gradient): a sharded run's crossing pieces under a sliding window compute about ``rows x
    window`` scores, and nothing for another rank's keys that no query of theirs sees.

    Pieces are numbered in order (problems, then rows); with dropout, piece ``i > 0`` draws its
    mask from ``derive_seed(dropout_seed, "piece", i)`` (piece 0, and an unsplit call, from
    ``dropout_seed`` itself). For calls the driver cannot split (a sharded run's crossing
    pieces hold one problem per batch row and every row of a segment)."""

    def __init__(self, kernel: Kernel, limit: BatchLimit) -> None:
        self.kernel, self.limit = kernel, limit

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = self._pieces(q, k, options)
        if pieces is None:
            return self.kernel.forward(q, k, v, options)
        skipped = any(not piece.chunk.sees_keys for piece in pieces)
        out = (q.new_zeros if skipped else q.new_empty)((*q.shape[:3], v.shape[-1]))
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=accumulation_dtype(q.dtype))
        for i, piece in enumerate(pieces):
            if not piece.chunk.sees_keys:
                continue
            part_out, part_lse = self.kernel.forward(
                piece.queries(q), piece.keys(k), piece.keys(v), _seeded(piece.chunk.options, i)
            )
            piece.queries(out).copy_(part_out)
            piece.queries(lse).copy_(part_lse)
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
        return self._backward(dout, None, q, k, v, out, lse, options)

    def backward_with_lse(
        self,
        dout: torch.Tensor,
        dlse: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """:meth:`backward` with the gradient through the lse (``dlse``, split with the query
        rows), each piece by :func:`~ringdilated.core.contract.lse.backward_with_lse`: one
        kernel call where the kernel takes ``dlse``, else two."""
        return self._backward(dout, dlse, q, k, v, out, lse, options)

    def _backward(
        self,
        dout: torch.Tensor,
        dlse: torch.Tensor | None,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        def call(
            dout: torch.Tensor,
            dlse: torch.Tensor | None,
            q: torch.Tensor,
            k: torch.Tensor,
            v: torch.Tensor,
            out: torch.Tensor,
            lse: torch.Tensor,
            options: BlockOptions,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            if dlse is None:
                return self.kernel.backward(dout, q, k, v, out, lse, options)
            return backward_with_lse(self.kernel, dout, dlse, q, k, v, out, lse, options)

        pieces = self._pieces(q, k, options)
        if pieces is None:
            return call(dout, dlse, q, k, v, out, lse, options)
        # Row chunks of one problem add into its dk, dv (so do pieces of some of its keys, and
        # a piece not computed leaves zeros); pieces of whole problems are copied.
        summed = any(
            piece.chunk.rows < q.shape[2] or piece.chunk.key_stop is not None for piece in pieces
        )
        skipped = any(not piece.chunk.sees_keys for piece in pieces)
        dq = (torch.zeros_like if skipped else torch.empty_like)(q)
        acc = accumulation_dtype(q.dtype)
        dk, dv = (_buffer(x, acc if summed else x.dtype, summed) for x in (k, v))
        for i, piece in enumerate(pieces):
            if not piece.chunk.sees_keys:
                continue
            dout_p, q_p, out_p, lse_p = (piece.queries(x) for x in (dout, q, out, lse))
            k_p, v_p, options_p = piece.keys(k), piece.keys(v), _seeded(piece.chunk.options, i)
            dlse_p = None if dlse is None else piece.queries(dlse)
            gq, gk, gv = call(dout_p, dlse_p, q_p, k_p, v_p, out_p, lse_p, options_p)
            piece.queries(dq).copy_(gq)
            for buffer, grad in ((dk, gk), (dv, gv)):
                if summed:
                    piece.keys(buffer).add_(grad)
                else:
                    piece.keys(buffer).copy_(grad)
        return dq, dk.to(k.dtype), dv.to(v.dtype)

    def _pieces(
        self, q: torch.Tensor, k: torch.Tensor, options: BlockOptions
    ) -> list[_Piece] | None:
        """The pieces of a call on ``q`` and ``k``, in order; ``None`` when the call runs whole
        (it fits, and its window neither hides a key from every row nor is worth banding)."""
        n, heads, rows, dim = q.shape
        kv_heads, k_len = k.shape[1], k.shape[2]
        budget = self.limit.query_elements
        limits = [n]
        per_call = self.limit.per_call(kv_heads)
        if per_call is not None:
            limits.append(per_call)
        if budget is not None:
            limits.append(budget // max(1, heads * rows * dim))
        step = max(1, min(limits))
        window = options.window
        whole = window.visible_keys(0, rows, k_len) == (0, k_len)
        bands = not self.limit.skips_hidden_keys
        banded = bands and window_chunk_rows(window, rows, k_len) is not None
        if step >= n and (budget is None or q.numel() <= budget) and whole and not banded:
            return None
        pieces: list[_Piece] = []
        for first in range(0, n, step):
            count = min(step, n - first)
            chunks = row_chunks(rows, count * heads * dim, budget, options, k_len, bands)
            pieces.extend(_Piece(first, count, chunk) for chunk in chunks)
        return pieces


def _seeded(options: BlockOptions, piece: int) -> BlockOptions:
    """Piece ``piece``'s options: its own dropout seed (pieces of one shape would otherwise draw
    the same mask); forward and backward split alike, so they agree."""
    if piece == 0 or options.dropout_p == 0.0:
        return options
    return attrs.evolve(options, dropout_seed=derive_seed(options.dropout_seed, "piece", piece))


def _buffer(like: torch.Tensor, dtype: torch.dtype, summed: bool) -> torch.Tensor:
    """The buffer a split backward puts ``like``'s gradient together in: zeros in ``dtype``
    (the accumulation dtype) when pieces add into it, else uninitialised."""
    if summed:
        return torch.zeros(like.shape, dtype=dtype, device=like.device)
    return torch.empty(like.shape, dtype=dtype, device=like.device)
