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
from ringdilated.core.select.capabilities import BatchLimit

__all__ = ["BatchLimitedKernel", "RowChunk", "row_chunks"]


@attrs.frozen
class RowChunk:
    """Query rows ``[start, stop)`` of a call, and the call's ``options`` with the window shifted
    to row ``start`` (the chunk's own coordinates). Dropout seeds are the caller's to set."""

    start: int
    stop: int
    options: BlockOptions

    @property
    def rows(self) -> int:
        return self.stop - self.start


def row_chunks(
    rows: int, row_elements: int, budget: int | None, options: BlockOptions
) -> Iterator[RowChunk]:
    """A call's ``rows`` query rows, first to last, in chunks of at most ``budget`` query
    elements (``row_elements`` a row: problems x query heads x head dim), at least one row a
    chunk; one chunk of every row when they fit or ``budget`` is ``None`` (``options``
    unchanged)."""
    per_chunk = rows if budget is None else max(1, budget // max(1, row_elements))
    if per_chunk >= rows:
        yield RowChunk(0, rows, options)
        return
    for start in range(0, rows, per_chunk):
        window = options.window.shifted(start)
        yield RowChunk(start, min(rows, start + per_chunk), attrs.evolve(options, window=window))


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
        """This piece of ``k`` or ``v``: its problems, every key."""
        return x.narrow(0, self.first, self.count)


class BatchLimitedKernel:
    """``kernel`` with every call held to ``limit``: split along ``N`` into pieces of at most
    ``limit.per_call(kv_heads)`` problems and ``limit.query_elements`` query elements, and a
    problem larger than that along its query rows (:func:`row_chunks`); results as the one call's
    (``dk``, ``dv`` of a problem's row chunks summed in the accumulation dtype, then cast).

    Pieces are numbered in order (problems, then rows); with dropout, piece ``i > 0`` draws its
    mask from ``derive_seed(dropout_seed, "piece", i)`` (piece 0, and an unsplit call, from
    ``dropout_seed`` itself). For calls the driver cannot split (a sharded run's crossing
    pieces hold one problem per batch row and every row of a segment)."""

    def __init__(self, kernel: Kernel, limit: BatchLimit) -> None:
        self.kernel, self.limit = kernel, limit

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        pieces = self._pieces(q, k.shape[1], options)
        if pieces is None:
            return self.kernel.forward(q, k, v, options)
        out = lse = None
        for i, piece in enumerate(pieces):
            part_out, part_lse = self.kernel.forward(
                piece.queries(q), piece.keys(k), piece.keys(v), _seeded(piece.chunk.options, i)
            )
            if out is None or lse is None:
                out = part_out.new_empty((*q.shape[:3], part_out.shape[-1]))
                lse = part_lse.new_empty(q.shape[:3])
            piece.queries(out).copy_(part_out)
            piece.queries(lse).copy_(part_lse)
        assert out is not None and lse is not None
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

        pieces = self._pieces(q, k.shape[1], options)
        if pieces is None:
            return call(dout, dlse, q, k, v, out, lse, options)
        # Row chunks of one problem add into its dk, dv; pieces of whole problems are copied.
        summed = any(piece.chunk.rows < q.shape[2] for piece in pieces)
        dq = dk = dv = None
        for i, piece in enumerate(pieces):
            dout_p, q_p, out_p, lse_p = (piece.queries(x) for x in (dout, q, out, lse))
            k_p, v_p, options_p = piece.keys(k), piece.keys(v), _seeded(piece.chunk.options, i)
            dlse_p = None if dlse is None else piece.queries(dlse)
            gq, gk, gv = call(dout_p, dlse_p, q_p, k_p, v_p, out_p, lse_p, options_p)
            if dq is None or dk is None or dv is None:
                dq = gq.new_empty(q.shape)
                dk, dv = (_buffer(g, like, summed) for g, like in ((gk, k), (gv, v)))
            piece.queries(dq).copy_(gq)
            for buffer, grad in ((dk, gk), (dv, gv)):
                if summed:
                    piece.keys(buffer).add_(grad)
                else:
                    piece.keys(buffer).copy_(grad)
        assert dq is not None and dk is not None and dv is not None
        return dq, dk.to(k.dtype), dv.to(v.dtype)

    def _pieces(self, q: torch.Tensor, kv_heads: int, options: BlockOptions) -> list[_Piece] | None:
        """The pieces of a call on ``q``, in order; ``None`` when the call fits whole."""
        n, heads, rows, dim = q.shape
        budget = self.limit.query_elements
        limits = [n]
        per_call = self.limit.per_call(kv_heads)
        if per_call is not None:
            limits.append(per_call)
        if budget is not None:
            limits.append(budget // max(1, heads * rows * dim))
        step = max(1, min(limits))
        if step >= n and (budget is None or q.numel() <= budget):
            return None
        pieces: list[_Piece] = []
        for first in range(0, n, step):
            count = min(step, n - first)
            chunks = row_chunks(rows, count * heads * dim, budget, options)
            pieces.extend(_Piece(first, count, chunk) for chunk in chunks)
        return pieces


def _seeded(options: BlockOptions, piece: int) -> BlockOptions:
    """Piece ``piece``'s options: its own dropout seed (pieces of one shape would otherwise draw
    the same mask); forward and backward split alike, so they agree."""
    if piece == 0 or options.dropout_p == 0.0:
        return options
    return attrs.evolve(options, dropout_seed=derive_seed(options.dropout_seed, "piece", piece))


def _buffer(grad: torch.Tensor, like: torch.Tensor, summed: bool) -> torch.Tensor:
    """The buffer a split backward puts ``like``'s gradient together in: zeros in the
    accumulation dtype when row chunks add into it, else uninitialised in ``grad``'s dtype."""
    if summed:
        return torch.zeros(like.shape, dtype=accumulation_dtype(grad.dtype), device=grad.device)
    return grad.new_empty(like.shape)
